import numpy as np
import pytest
import tensorflow as tf

from tpu_helpers.data import hub, mlm
from tpu_helpers.tf_engine import tf_classes


@pytest.fixture(scope="module")
def tokenizer(fixtures_dir):

    return hub.load_tokenizer(str(fixtures_dir / "tiny-distilbert"))


@pytest.fixture(scope="module")
def corpus(fixtures_dir):
    from datasets import load_dataset

    sentences = load_dataset(str(fixtures_dir / "cola"))["train"]["sentence"][:2400]
    from datasets import Dataset

    texts = [" ".join(sentences[i : i + 4]) for i in range(0, len(sentences), 4)] + ["", "  "]
    return Dataset.from_dict({"text": texts})


def test_blocks_are_full_and_documents_separated(tokenizer, corpus):
    blocks = mlm.pack_blocks(corpus, tokenizer, block_size=32, batch_size=50)
    ids = np.asarray(blocks["input_ids"])
    assert ids.shape[1] == 32 and len(ids) > 10
    assert (ids[:, 0] == tokenizer.cls_token_id).all()
    assert not (ids == tokenizer.pad_token_id).any()  # every position is a real token
    documents = sum(1 for t in corpus["text"] if t.strip())
    stream = sum(
        len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1
        for t in corpus["text"]
        if t.strip()
    )
    kept = ids[:, 1:].size
    # what is dropped is the tail of each map batch: under one block per batch of documents
    assert stream - 31 * (-(-len(corpus) // 50)) <= kept <= stream
    assert (ids == tokenizer.sep_token_id).sum() >= documents - 2 * (-(-len(corpus) // 50))


def _batch(tokenizer, corpus, rows=64, width=128):
    blocks = mlm.pack_blocks(corpus, tokenizer, block_size=width, batch_size=1000)
    ids = np.asarray(blocks["input_ids"][:rows], np.int32)
    assert ids.shape == (rows, width)
    return ids


def _rates(original, masked, chosen, tokenizer):
    special = np.isin(original, tokenizer.all_special_ids)
    chosen = chosen.astype(bool)
    return {
        "chosen of non-special": chosen[~special].mean(),
        "special chosen": chosen[special].mean() if special.any() else 0.0,
        "mask": (masked[chosen] == tokenizer.mask_token_id).mean(),
        "kept": (masked[chosen] == original[chosen]).mean(),
        "untouched outside": (masked[~chosen] == original[~chosen]).mean(),
    }


def test_masking_statistics_match_the_data_collator(tokenizer, corpus):
    from transformers import DataCollatorForLanguageModeling

    ids = _batch(tokenizer, corpus)
    masked, labels, weights = mlm.mask_tokens(
        ids, [3, 0], tokenizer.mask_token_id, len(tokenizer), tokenizer.all_special_ids
    )
    ours = _rates(ids, masked.numpy(), weights.numpy(), tokenizer)
    np.testing.assert_array_equal(labels.numpy(), ids)

    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, return_tensors="np")
    np.random.seed(0)
    out = collator([{"input_ids": row} for row in ids])
    theirs = _rates(ids, out["input_ids"], out["labels"] != -100, tokenizer)
    for name, expected, tolerance in [
        ("chosen of non-special", 0.15, 0.02),  # 0.10 or 0.20 would be far outside
        ("mask", 0.8, 0.05),
        ("kept", 0.1 + 0.1 / len(tokenizer), 0.04),  # random ids that hit the original too
    ]:
        assert abs(ours[name] - expected) < tolerance, (name, ours)
        assert abs(theirs[name] - expected) < tolerance, (name, theirs)
    assert ours["special chosen"] == 0 and ours["untouched outside"] == 1.0
    got, chosen = masked.numpy(), weights.numpy().astype(bool)
    replaced = got[chosen & (got != tokenizer.mask_token_id) & (got != ids)]
    assert abs(len(replaced) / chosen.sum() - 0.1) < 0.04  # the random-token tenth
    # spread over the vocabulary: about as many distinct ids as uniform draws would give
    vocab, n = len(tokenizer), len(replaced)
    assert len(set(replaced.tolist())) > 0.85 * vocab * (1 - (1 - 1 / vocab) ** n)
    assert replaced.max() > 0.8 * vocab


def test_random_replacements_reach_every_id_of_a_large_vocabulary():
    """XLM-R's 250,002 ids: every id can be drawn, about equally often (reading the id off
    the choosing draw reached half of them, with probabilities 1.5x apart)."""
    vocab = 250_002
    ids = tf.fill([4096, 512], 5)
    drawn = []
    for step in range(12):
        masked, _, weights = mlm.mask_tokens(ids, [7, step], 4, vocab, [0, 1, 2, 3, 4])
        masked = masked.numpy()
        drawn.append(masked[(masked != 4) & (masked != 5)])
    drawn = np.concatenate(drawn)
    assert abs(len(drawn) / (12 * ids.shape[0] * ids.shape[1]) - 0.015) < 0.001
    counts = np.bincount(drawn, minlength=vocab)
    # about 1.5 draws an id: uniform draws leave exp(-1.5) = 22 % of the ids undrawn (an
    # id that cannot be drawn at all adds to that: reading the id off the choosing draw
    # left 52 % undrawn)
    assert abs((counts == 0).mean() - np.exp(-len(drawn) / vocab)) < 0.005
    top, bottom = counts[: vocab // 2].sum(), counts[vocab // 2 :].sum()
    assert abs(top / bottom - 1) < 0.01


def test_the_same_step_gets_the_same_mask_and_epochs_differ(tokenizer, corpus):
    from tpu_helpers.core import pipeline

    ids = _batch(tokenizer, corpus, rows=64, width=32)
    plan = mlm.masked_batches(ids, tokenizer, global_batch=8, seed=5)
    assert plan.steps_per_epoch == 8 and plan.global_batch == 8
    run = list(plan.dataset(0))
    again = list(mlm.masked_batches(ids, tokenizer, global_batch=8, seed=5).dataset(0))
    # a run resumed at step 3 (skipping what was done) sees the masks of the uninterrupted one
    resumed = list(plan.dataset(0, skip_steps=3))
    for a, b in zip(run, again, strict=True):
        np.testing.assert_array_equal(a[0]["input_ids"], b[0]["input_ids"])
    np.testing.assert_array_equal(resumed[0][2], run[3][2])
    assert run[0][0]["input_ids"].shape == (8, 32) and run[0][2].dtype == tf.float32
    # the same rows in both epochs (unshuffled blocks): the masks alone differ
    rows = pipeline.from_arrays(
        {"input_ids": ids}, np.zeros(len(ids), np.int32), global_batch=8, shuffle=False
    )
    fixed = mlm.masked_batches(rows, tokenizer, seed=5)
    first, next_epoch = (list(fixed.dataset(e)) for e in (0, 1))
    for a, b in zip(first, next_epoch, strict=True):
        np.testing.assert_array_equal(a[1], b[1])  # the original ids: the same rows
    assert any((a[2].numpy() != b[2].numpy()).any() for a, b in zip(first, next_epoch, strict=True))


@pytest.fixture(scope="module")
def record_blocks(tokenizer, corpus, tmp_path_factory):
    """60 blocks of 32 ids as records (no labels), in shards of 16."""
    from tpu_helpers.data import records

    folder = tmp_path_factory.mktemp("blocks")
    blocks = _batch(tokenizer, corpus, rows=60, width=32)
    rows = [{"input_ids": b} for b in blocks]
    records.write_records(rows, str(folder), shard_records=16, progress=False)
    return blocks, str(folder)


@pytest.mark.parametrize("kind", ["array", "records"])
def test_a_resumed_masked_epoch_is_the_tail_of_the_whole_one(tokenizer, record_blocks, kind):
    """60 blocks in batches of 8: 8 steps, the last completed with 4 rows of weight 0."""
    from tpu_helpers.data import records

    blocks, folder = record_blocks

    def plan():
        if kind == "array":
            return mlm.masked_batches(blocks, tokenizer, global_batch=8, seed=7)
        source = records.read_records(folder, global_batch=8, label_column=None, seed=7)
        return mlm.masked_batches(source, tokenizer, seed=7)

    whole_plan = plan()
    assert whole_plan.steps_per_epoch == 8 and whole_plan.examples == 60
    for epoch in (0, 1):
        whole = [
            (f["input_ids"].numpy(), y.numpy(), w.numpy()) for f, y, w in whole_plan.dataset(epoch)
        ]
        assert len(whole) == len(list(whole_plan.dataset(epoch))) == whole_plan.steps_per_epoch
        labels = np.concatenate([y for _, y, _ in whole])
        weights = np.concatenate([w for _, _, w in whole])
        # every block once in the epoch's 60 first rows; the 4 copies after them count 0
        assert sorted(map(tuple, labels[:60])) == sorted(map(tuple, blocks))
        assert weights[60:].sum() == 0 and (weights[:60].sum(axis=1) > 0).mean() > 0.9
        resumed_plan = plan()  # a new process, resumed
        for skip in (1, 4, 7):
            part = list(resumed_plan.dataset(epoch, skip_steps=skip))
            assert len(part) == whole_plan.steps_per_epoch - skip
            for (ids, y, w), (f, y2, w2) in zip(whole[skip:], part, strict=True):
                np.testing.assert_array_equal(f["input_ids"], ids)  # the same masks
                np.testing.assert_array_equal(y2, y)
                np.testing.assert_array_equal(w2, w)


def test_rows_that_complete_a_short_record_batch_are_not_trained_on(tokenizer, corpus, tmp_path):
    from tpu_helpers.data import records

    blocks = _batch(tokenizer, corpus, rows=10, width=32)
    records.write_records([{"input_ids": b} for b in blocks], str(tmp_path), progress=False)
    batches = records.read_records(str(tmp_path), global_batch=8, label_column=None, shuffle=False)
    assert batches.steps_per_epoch == 2
    low_level = mlm.mask_batches(batches.dataset(), tokenizer, seed=1)  # 3-tuples taken
    for masked in (low_level, mlm.masked_batches(batches, tokenizer, seed=1).dataset()):
        (_, _, first), (_, _, last) = list(masked)
        # 10 blocks in batches of 8: the second batch has 2 blocks and 6 copies weighted 0
        assert (first.numpy().sum(axis=1) > 0).all()
        assert (last.numpy()[:2].sum(axis=1) > 0).all() and last.numpy()[2:].sum() == 0


def test_a_tokenizer_without_a_mask_token_is_refused(tokenizer):

    gpt2_like = hub.load_tokenizer(str(tokenizer.name_or_path))
    gpt2_like.mask_token = None
    with pytest.raises(ValueError, match="has no mask token"):
        mlm.masked_batches(np.zeros((8, 16), np.int32), gpt2_like, global_batch=4)


def test_a_run_of_a_few_blocks_reads_only_the_leading_text_they_need():
    from datasets import Dataset

    lines = Dataset.from_dict({"text": ["x" * (i % 7) * 10 for i in range(25_000)]})
    need = 40 * 16 * mlm.CHARACTERS_PER_TOKEN  # 3,840 characters
    taken = mlm.leading_text(lines, "text", 40, 16, chunk=64)
    sizes = [len(t) for t in taken["text"]]
    assert sum(sizes) >= need > sum(sizes[:-1])  # enough, and not one row more
    assert taken["text"] == lines["text"][: len(taken)]
    assert len(mlm.leading_text(lines, "text", 10**6, 512)) == len(lines)  # all there is
    with pytest.raises(ValueError, match="blocks=0"):
        mlm.leading_text(lines, "text", 0, 16)


def test_blank_lines_and_headings_are_dropped():
    from datasets import Dataset

    lines = [
        "",
        " = Valkyria Chronicles = ",
        "",
        " The game began development . ",
        " = = Plot = = ",
        "   ",
        " It is set in 1935 . ",
    ]
    kept = mlm.clean_lines(Dataset.from_dict({"text": lines}))["text"]
    assert kept == [" The game began development . ", " It is set in 1935 . "]


@pytest.mark.parametrize("kind, mask", [("wordpiece", "[MASK]"), ("bpe", "<mask>")])
def test_a_trained_tokenizer_loads_back_with_autotokenizer(tmp_path, corpus, kind, mask):

    tokenizer = mlm.train_tokenizer(corpus, str(tmp_path / kind), vocab_size=400, kind=kind)
    again = hub.load_tokenizer(str(tmp_path / kind))
    assert tokenizer.mask_token == again.mask_token == mask and len(again) <= 400
    ids = again("The cat sleeps.")["input_ids"]
    assert ids[0] in (again.cls_token_id, again.bos_token_id) and ids[-1] in (
        again.sep_token_id,
        again.eos_token_id,
    )
    assert again.decode(ids, skip_special_tokens=True).replace(" ", "") == "Thecatsleeps."


def test_a_model_that_cannot_take_the_blocks_is_refused_before_training(tokenizer):
    from transformers import AutoConfig

    fits = AutoConfig.for_model("distilbert", vocab_size=len(tokenizer), max_position_embeddings=64)
    mlm.check_model_fits(fits, tokenizer, 64)
    small_vocab = AutoConfig.for_model("distilbert", vocab_size=100)
    with pytest.raises(
        ValueError, match=f"tokenizer has {len(tokenizer)} tokens, the model's vocabulary 100"
    ):
        mlm.check_model_fits(small_vocab, tokenizer, 64)
    with pytest.raises(ValueError, match="block_size=128 exceeds the distilbert model's 64"):
        mlm.check_model_fits(fits, tokenizer, 128)


def test_continued_pretraining_of_the_tiny_checkpoint_lowers_its_loss(
    fixtures_dir, tokenizer, corpus
):
    from transformers import AutoConfig, TFAutoModelForMaskedLM

    checkpoint = str(fixtures_dir / "tiny-distilbert")
    mlm.check_model_fits(AutoConfig.from_pretrained(checkpoint), tokenizer, 32)
    tf.keras.utils.set_random_seed(0)
    model = tf_classes.from_pretrained(TFAutoModelForMaskedLM, checkpoint)
    model.compile(
        optimizer=tf.keras.optimizers.Adam(3e-3),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[
            tf.keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="mlm_loss")
        ],
    )
    blocks = np.asarray(mlm.pack_blocks(corpus, tokenizer, 32)["input_ids"][:256], np.int32)
    data = mlm.masked_batches(blocks, tokenizer, global_batch=16, seed=0).dataset(0)
    before = mlm.perplexity(model.evaluate(data, verbose=0, return_dict=True))
    model.fit(data, epochs=3, verbose=0)
    after = mlm.perplexity(model.evaluate(data, verbose=0, return_dict=True))
    assert after < 0.5 * before, (before, after)
