import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import assert_same_batches, numpy_batches
from tpu_helpers.core import families
from tpu_helpers.data import hub, text
from tpu_helpers.teaching.fixtures import CPU_TRAIN_ROWS


def brute_force_best(lengths, max_shapes, multiple=8):
    top = text._round_up(max(lengths), multiple)
    candidates = list(range(multiple, top, multiple))
    best = None
    for k in range(0, max_shapes):
        for combo in itertools.combinations(candidates, k):
            bounds = [*combo, top]
            padded = text.padding_report(lengths, bounds).padded_tokens
            best = padded if best is None else min(best, padded)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_shapes", [1, 2, 3, 4])
def test_chosen_boundaries_are_optimal(seed, max_shapes):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(2.4, 0.45, 400).astype(int), 2, 70)
    chosen = text.choose_boundaries(lengths, max_shapes)
    assert len(chosen) <= max_shapes
    assert all(b % 8 == 0 for b in chosen) and chosen == sorted(set(chosen))
    assert chosen[-1] >= lengths.max()
    assert text.padding_report(lengths, chosen).padded_tokens == brute_force_best(
        lengths, max_shapes
    )


def test_more_shapes_never_pad_more():
    lengths = np.random.default_rng(0).integers(3, 60, 1000)
    shares = [
        text.padding_report(lengths, text.choose_boundaries(lengths, k)).real_token_share
        for k in range(1, 7)
    ]
    assert shares == sorted(shares) and shares[-1] > shares[0]


def test_max_length_caps_the_widest_boundary():
    assert text.choose_boundaries([5, 200], max_shapes=2, max_length=128)[-1] == 128
    assert text.padding_report([5, 200], [8, 128]).real_tokens == 5 + 128  # truncated


def test_schemes():
    lengths = [5, 12, 20, 40]
    assert text.padding_boundaries(lengths, "max_length", max_length=128) == [128]
    assert text.padding_boundaries(lengths, "multiple", multiple_of=32) == [32, 64]
    assert text.padding_boundaries(lengths, "buckets", max_shapes=4) == [8, 16, 24, 40]
    with pytest.raises(ValueError, match="'longest' is not one of"):
        text.padding_boundaries(lengths, "longest")


def test_padding_report_counts():
    rep = text.padding_report([3, 8, 9], [8, 16])
    assert (rep.real_tokens, rep.padded_tokens, rep.shapes) == (20, 32, 2)
    assert "62.5% real tokens" in str(rep)


@pytest.mark.parametrize("shuffle", [True, False])
def test_batch_plan_keeps_every_example_once_in_full_batches(shuffle):
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 60, 1003)
    bounds = text.choose_boundaries(lengths, 4)
    idx, widths, weights = text.batch_plan(lengths, bounds, 32, seed=3, shuffle=shuffle)
    assert idx.shape[1] == 32 and weights.shape == idx.shape and len(widths) == len(idx)
    real = idx[weights == 1]
    assert sorted(real.tolist()) == list(range(1003))  # each exactly once
    assert (weights == 0).sum() == len(idx) * 32 - 1003  # fillers only complete the last batch
    assert set(widths.tolist()) <= set(bounds)
    for row, width in zip(idx, widths, strict=True):
        assert lengths[row].max() <= width  # every row fits its batch's width


def test_batch_plan_differs_per_seed_and_is_reproducible():
    lengths = np.random.default_rng(2).integers(2, 30, 500)
    a = text.batch_plan(lengths, [8, 16, 32], 16, seed=1)
    b = text.batch_plan(lengths, [8, 16, 32], 16, seed=1)
    c = text.batch_plan(lengths, [8, 16, 32], 16, seed=2)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert not (a[0] == c[0]).all()


@pytest.mark.parametrize("run", [2, 4, 7])
def test_batches_grouped_in_runs_of_one_width_are_the_same_batches_reordered(run):
    lengths = np.random.default_rng(5).integers(2, 60, 2000)
    bounds = text.choose_boundaries(lengths, 4)
    plain = text.batch_plan(lengths, bounds, 16, seed=3)
    grouped = text.batch_plan(lengths, bounds, 16, seed=3, group_widths=run)
    assert sorted(map(tuple, grouped[0].tolist())) == sorted(map(tuple, plain[0].tolist()))
    widths = grouped[1].tolist()
    counts = {w: widths.count(w) for w in set(widths)}
    full = sum(c // run for c in counts.values())
    # the first `full` runs each hold `run` batches of one width; then each width's rest
    for start in range(0, full * run, run):
        assert len(set(widths[start : start + run])) == 1
    rest = widths[full * run :]
    assert len(rest) == sum(c % run for c in counts.values())
    assert rest == sorted(rest, key=rest.index)  # one block per width
    for width in counts:  # each width's batches keep the shuffled order
        mine = [tuple(r) for r, w in zip(grouped[0].tolist(), widths, strict=True) if w == width]
        theirs = [
            tuple(r)
            for r, w in zip(plain[0].tolist(), plain[1].tolist(), strict=True)
            if w == width
        ]
        assert mine == theirs


def test_runs_of_one_width_of_one_keep_the_order_and_refuse_nonsense():
    widths = [8, 16, 8, 32, 16]
    assert text.runs_of_one_width(widths, 1).tolist() == list(range(5))
    assert text.runs_of_one_width(widths, 2).tolist() == [0, 2, 1, 4, 3]
    with pytest.raises(ValueError, match="group_widths"):
        text.runs_of_one_width(widths, 0)


def test_too_small_data_set_is_refused():
    with pytest.raises(ValueError, match="7 examples, fewer than one global batch of 16"):
        text.batch_plan([5] * 7, [8], 16)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "8", True])
def test_bad_per_replica_batch(bad):
    with pytest.raises(ValueError, match=f"per_replica_batch={bad!r} is not a positive integer"):
        text.global_batch_size(bad, 8)
    assert text.global_batch_size(6, 8) == 48


def test_max_length_against_the_model_limit():
    config = SimpleNamespace(model_type="bert", max_position_embeddings=512)
    assert text.check_max_length(128, config) == 128
    with pytest.raises(ValueError, match="max_length=600 exceeds the bert model's limit of 512"):
        text.check_max_length(600, config)
    # notebook 06's blocks: the parameter named as the notebook names it
    with pytest.raises(ValueError, match="block_size=600 exceeds .* Fix: block_size <= 512"):
        text.check_max_length(600, config, name="block_size")
    with pytest.raises(ValueError, match="block_size=0 must be a positive"):
        text.check_max_length(0, config, name="block_size")


def test_position_limits_of_real_configs():
    from transformers import AutoConfig, DebertaV2Config

    assert families.position_limit(AutoConfig.for_model("bert")) == 512
    roberta = AutoConfig.for_model("roberta", max_position_embeddings=514)
    assert families.position_limit(roberta) == 512  # 514 less the offset of pad_token_id + 1
    assert (
        families.position_limit(AutoConfig.for_model("mpnet", max_position_embeddings=514)) == 512
    )
    assert families.position_limit(AutoConfig.for_model("gpt2")) == 1024
    small = AutoConfig.for_model("distilbert", max_position_embeddings=64)
    with pytest.raises(ValueError, match="limit of 64 positions"):
        text.check_max_length(128, small)
    assert families.position_limit(DebertaV2Config(position_biased_input=False)) is None


def test_a_model_without_a_position_limit_takes_max_length_as_given():
    from transformers import AutoConfig

    funnel = AutoConfig.for_model("funnel")  # relative attention: no max_position_embeddings
    assert families.position_limit(funnel) is None
    said = []
    assert text.check_max_length(4096, funnel, log=said.append) == 4096
    assert len(said) == 1 and "funnel model names no position limit" in said[0], said
    said.clear()
    text.check_max_length(128, AutoConfig.for_model("bert"), log=said.append)
    assert said == []  # a model with a limit within it: nothing to say


def test_a_tokenizer_is_not_taken_for_a_config(fixtures_dir):

    tokenizer = hub.load_tokenizer(str(fixtures_dir / "tiny-distilbert"))
    with pytest.raises(TypeError, match="needs a model config, got DistilBertTokenizerFast"):
        text.check_max_length(128, tokenizer)


def test_load_errors_name_the_split_and_column(fixtures_dir):
    cola = str(fixtures_dir / "cola")
    assert text.load_text_dataset(cola)["train"].num_rows == CPU_TRAIN_ROWS["cola"]
    with pytest.raises(ValueError, match="has no split 'test'; it has \\['train', 'validation'\\]"):
        text.load_text_dataset(cola, splits=("train", "test"))
    with pytest.raises(
        ValueError, match="has no column 'text'; its columns are \\['sentence', 'label', 'idx'\\]"
    ):
        text.load_text_dataset(cola, columns=("text", "label"))
    with pytest.raises(ValueError, match="Could not load data set"):
        text.load_text_dataset(str(fixtures_dir / "no-such-folder"))


def _counting_split(seed, n=100):
    """Rows 1..length as token ids, label = length % 2: a batch row tells its own length."""
    lengths = np.random.default_rng(seed).integers(2, 40, n)
    return {
        "input_ids": [list(range(1, k + 1)) for k in lengths],
        "length": lengths.tolist(),
        "label": [int(k % 2) for k in lengths],
    }


def test_tf_dataset_batches_match_the_plan():
    import tensorflow as tf

    split = _counting_split(seed=0)
    lengths = np.array(split["length"])
    bounds = text.choose_boundaries(lengths, 3)
    batches = text.text_batches(split, global_batch=16, boundaries=bounds)
    assert batches.steps_per_epoch == 7
    assert (batches.global_batch, batches.examples, batches.max_width) == (16, 100, bounds[-1])
    assert batches.padding == text.padding_report(lengths, bounds)
    orders = []
    for epoch in range(2):  # what epochs=2 did: two epochs, each every example once
        seen_weight = 0.0
        steps = 0
        order = []
        for features, labels, weights in batches.dataset(epoch):
            ids, mask = features["input_ids"].numpy(), features["attention_mask"].numpy()
            assert ids.shape[0] == 16 and ids.shape[1] in bounds
            row_lengths = mask.sum(1)
            assert (ids[mask == 0] == 0).all() and (ids[:, 0] == 1).all()
            assert (labels.numpy() == row_lengths % 2).all()  # labels travel with their rows
            seen_weight += float(tf.reduce_sum(weights))
            order.append(row_lengths.tolist())
            steps += 1
        assert seen_weight == 100
        assert steps == batches.steps_per_epoch
        orders.append(order)
    assert orders[0] != orders[1]  # each epoch shuffled anew


def _resume_split():
    lengths = list(range(2, 66))
    return {
        "input_ids": [[1] * n for n in lengths],
        "length": lengths,
        "label": [n % 3 for n in lengths],
    }


def test_skip_steps_resumes_at_the_same_batch():
    split = _resume_split()
    full = [
        f["attention_mask"].numpy().sum()
        for f, _, _ in text.text_batches(
            split, global_batch=8, boundaries=[16, 32, 64], seed=4
        ).dataset()
    ]
    tail = [
        f["attention_mask"].numpy().sum()
        for f, _, _ in text.text_batches(
            split, global_batch=8, boundaries=[16, 32, 64], seed=4
        ).dataset(skip_steps=3)
    ]
    assert tail == full[3:]


@pytest.mark.parametrize("epoch", [0, 1, 3])
def test_text_batches_keep_the_contract(epoch):
    """The contract of a Batches: ``dataset(e, skip_steps=k)`` is exactly the tail of
    ``dataset(e)`` from step k (in a new plan too: a resumed process), an epoch has
    ``steps_per_epoch`` batches whose weights sum to the examples, and every element is
    ``(features, labels, weights)``."""
    split = _resume_split()

    def plan():
        return text.text_batches(split, global_batch=8, boundaries=[16, 32, 64], seed=4)

    batches = plan()
    whole = numpy_batches(batches.dataset(epoch))
    assert len(whole) == len(list(batches.dataset(epoch))) == batches.steps_per_epoch
    assert sum(float(w.sum()) for _, _, w in whole) == len(split["length"]) == batches.examples
    for element in batches.dataset(epoch):
        assert isinstance(element, tuple) and len(element) == 3
        features, labels, weights = element
        assert isinstance(features, dict) and labels.shape == weights.shape == (8,)
    resumed = plan()
    for skip in range(1, batches.steps_per_epoch):
        part = numpy_batches(resumed.dataset(epoch, skip_steps=skip))
        assert_same_batches(part, whole[skip:])
    with pytest.raises(ValueError, match="skip_steps="):
        batches.dataset(epoch, skip_steps=batches.steps_per_epoch)


def test_count_steps_matches_the_plan():
    lengths = np.random.default_rng(5).integers(2, 60, 777)
    for seed in range(3):
        assert text.count_steps(lengths, [16, 32, 64], 32) == len(
            text.batch_plan(lengths, [16, 32, 64], 32, seed)[0]
        )


# --- bad input where it enters --------------------------------------------------------
def _split(labels, n=None):
    n = n or len(labels)
    return {"input_ids": [[101, 7, 102]] * n, "length": [3] * n, "label": labels}


@pytest.mark.parametrize(
    "labels, num_labels, message",
    [
        ([0, 1, -1, 0], None, "label -1 at row 2.*GLUE test splits"),
        ([0, 1, None, 0], None, "missing value \\(None\\) at row 2"),
        ([0, 1.5, 1, 0], None, "label 1.5 at row 1"),
        ([0, 1, 3, 0], 2, "label 3 at row 2, outside \\[0, 2\\).*num_labels=4"),
        (["a", "b", "a", "b"], None, "not class numbers"),
    ],
)
def test_bad_labels_are_named_with_their_row(labels, num_labels, message):
    with pytest.raises(ValueError, match=message):
        text.text_batches(_split(labels), global_batch=2, boundaries=[4], num_labels=num_labels)


def test_examples_longer_than_the_widest_width_are_cut_and_said(capsys):
    """Widths chosen on one split (the training set's) may be narrower than another split's
    longest example: it is kept, cut to the widest width, and the run says how many."""
    split = {
        "input_ids": [
            [101, 7, 102],
            [101, 7, 7, 7, 7, 7, 102],
            [101, 102],
            [101, 8, 102],
            [101, 102],
        ],
        "length": [3, 7, 2, 3, 2],
        "label": [0, 1, 0, 1, 0],
    }
    batches = text.text_batches(split, global_batch=4, boundaries=[4], shuffle=False)
    said = capsys.readouterr().out
    assert "1 of 5 examples are longer than the widest width 4 and are cut to it" in said
    rows = [
        (ids.tolist(), weight)
        for features, _, weights in batches.dataset(0).as_numpy_iterator()
        for ids, weight in zip(features["input_ids"], weights, strict=True)
    ]
    assert sum(weight for _, weight in rows) == 5 and all(len(ids) == 4 for ids, _ in rows)
    assert ([101, 7, 7, 7], 1) in rows  # kept, its first 4 tokens
    text.text_batches(split, global_batch=4, boundaries=[8], shuffle=False)
    assert "longer than the widest" not in capsys.readouterr().out  # none cut: nothing said


@pytest.mark.parametrize(
    "boundaries, fix",
    [([64, 32], "\\[32, 64\\]"), ([0, 16], "\\[16\\]"), ([16, 16, 32], "\\[16, 32\\]")],
)
def test_bad_widths_are_refused_with_the_list_to_use(boundaries, fix):
    with pytest.raises(ValueError, match=f"Fix: boundaries={fix}"):
        text.text_batches(_split([0, 1, 0, 1]), global_batch=2, boundaries=boundaries)
    with pytest.raises(ValueError, match="positive and increasing"):
        text.batch_plan([3, 3], boundaries, 2)


@pytest.mark.parametrize("boundaries", [[0], [-8, 0]])
def test_widths_with_none_above_zero_get_a_fix_that_is_not_refused_in_turn(boundaries):
    with pytest.raises(ValueError, match=r"Fix: text\.choose_boundaries\(lengths\)") as refused:
        text.text_batches(_split([0, 1, 0, 1]), global_batch=2, boundaries=boundaries)
    assert "boundaries=[]" not in str(refused.value)
    fixed = text.choose_boundaries([3, 5, 9, 12])
    assert text.text_batches(_split([0, 1, 0, 1]), global_batch=2, boundaries=fixed).widths


def test_a_missing_column_is_named():
    split = _split([0, 1])
    del split["length"]
    with pytest.raises(ValueError, match="no column 'length'.*text.tokenize"):
        text.text_batches(split, global_batch=2, boundaries=[4])


def test_sentence_pairs_are_tokenized_with_token_types_and_batched_with_them(fixtures_dir):
    from datasets import Dataset

    from tpu_helpers.teaching.fixtures import make_mrpc_like

    rows = make_mrpc_like(0, {"train": 20})["train"]
    split = Dataset.from_list(rows)
    bert = hub.load_tokenizer(str(fixtures_dir / "tiny-bert"))
    pairs = text.tokenize(split, bert, 128, "sentence1", text_pair_column="sentence2")
    alone = text.tokenize(split, bert, 128, "sentence1")
    assert "token_type_ids" in pairs.column_names and "token_type_ids" not in alone.column_names
    for row, ids, types in zip(rows, pairs["input_ids"], pairs["token_type_ids"], strict=True):
        expected = bert(row["sentence1"], row["sentence2"])
        assert ids == expected["input_ids"] and types == expected["token_type_ids"]
        assert 0 < sum(types) < len(types)  # the second sentence and its separator
    batches = text.text_batches(pairs, global_batch=8, boundaries=[64, 128], shuffle=False)
    features, _, weights = next(iter(batches.dataset()))
    assert set(features) == {"input_ids", "token_type_ids", "attention_mask"}
    first = int(np.flatnonzero(weights.numpy())[0])
    n = len(pairs["token_type_ids"][0])
    assert features["token_type_ids"][first, :n].numpy().tolist() == pairs["token_type_ids"][0]
    assert not features["token_type_ids"][first, n:].numpy().any()  # padding: type 0
    # a tokenizer without token types (DistilBERT's) joins the pair without them
    distil = hub.load_tokenizer(str(fixtures_dir / "tiny-distilbert"))
    joined = text.tokenize(split, distil, 128, "sentence1", text_pair_column="sentence2")
    assert "token_type_ids" not in joined.column_names
    assert joined["input_ids"][0].count(distil.sep_token_id) == 2


def test_missing_text_and_empty_splits_are_named():
    from datasets import Dataset

    from tpu_helpers.teaching.fixtures import make_mrpc_like

    rows = make_mrpc_like(0, {"train": 4})["train"]
    rows[2]["sentence2"] = None

    class Whitespace:  # enough of a tokenizer for the check, which comes first
        model_input_names = ["input_ids", "attention_mask"]

    with pytest.raises(ValueError, match="Column 'sentence2' has a missing value .None. at row 2"):
        text.tokenize(Dataset.from_list(rows), Whitespace(), 32, "sentence1", 1000, "sentence2")
    with pytest.raises(
        ValueError, match=r"no column 'text' .* \['sentence1', .* Fix: text_column="
    ):
        text.tokenize(Dataset.from_list(rows), Whitespace(), 32, "text")
    empty = {"input_ids": [], "length": [], "label": []}
    with pytest.raises(ValueError, match="no examples"):
        text.text_batches(empty, global_batch=8, boundaries=[16])
