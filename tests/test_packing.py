"""Packed fine-tuning: the packing is exact and tight, and the packed forward pass of each
covered family equals the model's own call on the same examples, single sentences and
pairs alike (logits and gradients), through the tokenizer and data path of notebook 07."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_helpers.core import families
from tpu_helpers.data import hub, packing
from tpu_helpers.tf_engine import packed_classes, tf_classes

RNG = np.random.default_rng(0)


def test_pack_rows_places_every_example_once_within_the_limits():
    lengths = RNG.integers(3, 60, size=500)
    rows = packing.pack_rows(lengths, 128, max_per_row=6, seed=1)
    placed = sorted(i for r in rows for i in r)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 128 and 1 <= len(r) <= 6 for r in rows)
    # tight: no two rows could be merged
    totals = sorted(sum(lengths[i] for i in r) for r in rows if len(r) <= 3)
    assert len(totals) < 2 or totals[0] + totals[1] > 128
    assert rows == packing.pack_rows(lengths, 128, max_per_row=6, seed=1)  # deterministic
    assert rows != packing.pack_rows(lengths, 128, max_per_row=6, seed=2)  # per-epoch seeds


def test_pack_rows_refuses_examples_longer_than_the_row():
    with pytest.raises(ValueError, match="max_length=16"):
        packing.pack_rows([4, 20, 3], 16)


def test_packing_the_cola_like_fixture_is_nearly_all_real_tokens(fixtures_dir):
    from datasets import load_dataset

    tokenizer = hub.load_tokenizer(str(fixtures_dir / "tiny-distilbert"))
    sentences = load_dataset(str(fixtures_dir / "cola"))["train"]["sentence"]
    lengths = [
        len(ids) for ids in tokenizer(list(sentences), truncation=True, max_length=128)["input_ids"]
    ]
    rows = packing.pack_rows(lengths, 128, max_per_row=16)
    report = packing.pack_report(lengths, rows, 128)
    print(report)
    assert report.examples == len(lengths)
    assert report.real_token_share >= 0.95, report


def test_packed_arrays_hold_each_example_with_restarted_positions():
    examples = [list(RNG.integers(5, 99, size=n)) for n in (5, 3, 7, 2, 6, 4)]
    labels = [0, 1, 2, 1, 0, 2]
    rows = packing.pack_rows([len(e) for e in examples], 12, max_per_row=3)
    arrays = packing.packed_arrays(examples, labels, rows, 12, 3, pad_token_id=0)
    assert arrays["input_ids"].shape == (len(rows), 12)
    assert arrays["weights"].sum() == len(examples)
    for r, row in enumerate(rows):
        for slot, index in enumerate(row):
            cols = np.flatnonzero(arrays["segment_ids"][r] == slot + 1)
            assert cols[0] == arrays["starts"][r, slot]
            assert arrays["input_ids"][r, cols].tolist() == examples[index]
            assert arrays["position_ids"][r, cols].tolist() == list(range(len(examples[index])))
            assert arrays["labels"][r, slot] == labels[index]
        assert arrays["weights"][r, len(row) :].sum() == 0
        assert (arrays["input_ids"][r][arrays["segment_ids"][r] == 0] == 0).all()


# Random weights at the usual initializer range (0.02) make a tiny model's logits almost
# independent of its input (they differ by about 5e-5 between examples), too little for
# an equality of logits to tell a right mask from a wrong one; at 0.2 they differ by 0.3-0.9.
SENSITIVE = {"initializer_range": 0.2}


def tiny_model(family):
    from transformers import TFAutoModelForSequenceClassification

    from tpu_helpers.teaching.fixtures import tiny_config

    config = tiny_config(family, 100, 1 if family == "roberta" else 0, 3, **SENSITIVE)
    tf.keras.utils.set_random_seed(0)
    model = TFAutoModelForSequenceClassification.from_config(config)
    model(model.dummy_inputs)
    return model


def packed_batch(examples, labels, width=24, per_row=3, pad=0):
    rows = packing.pack_rows([len(e) for e in examples], width, max_per_row=per_row)
    arrays = packing.packed_arrays(examples, labels, rows, width, per_row, pad_token_id=pad)
    features = {
        k: tf.constant(arrays[k]) for k in ("input_ids", "segment_ids", "position_ids", "starts")
    }
    return rows, features, arrays


def alone(model, example):
    ids = tf.constant([example])
    return model(input_ids=ids, attention_mask=tf.ones_like(ids), training=False).logits[0]


EXAMPLES = [
    [2, 11, 12, 13, 3],
    [2, 21, 22, 3],
    [2, 31, 32, 33, 34, 35, 3],
    [2, 41, 3],
    [2, 51, 52, 53, 54, 3],
    [2, 61, 62, 63, 64, 65, 66, 67, 3],
]
LABELS = [0, 1, 2, 1, 0, 2]


# --- every family, through notebook 01's data path ----------------------------------------
@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory):
    """family -> folder of a tiny random checkpoint with its family's kind of tokenizer
    (built on first use), loaded below with the calls notebook 01 makes."""
    from tpu_helpers.teaching import fixtures

    corpus = [r["sentence"] for r in fixtures.make_cola_like(1, {"train": 400})["train"]]
    root = tmp_path_factory.mktemp("families")
    built = {}

    def get(family):
        if family not in built:
            fixtures.write_tiny_checkpoint(root / family, family, corpus, **SENSITIVE)
            built[family] = root / family
        return built[family]

    return get


class Family:
    """A family's tokenizer and classifier, a few MRPC-like examples tokenized and batched
    by notebook 01's bucketed path, and the same examples packed."""

    def __init__(self, folder, pairs):
        from datasets import Dataset
        from transformers import TFAutoModelForSequenceClassification

        from tpu_helpers.data import hub, text
        from tpu_helpers.teaching import fixtures
        from tpu_helpers.tf_engine import tf_classes

        self.tokenizer = hub.load_tokenizer(folder)
        tf.keras.utils.set_random_seed(0)
        self.model = tf_classes.from_pretrained(
            TFAutoModelForSequenceClassification, folder, num_labels=2
        )
        rows = fixtures.make_mrpc_like(3, {"train": 10})["train"]
        split = text.tokenize(
            Dataset.from_list(rows),
            self.tokenizer,
            128,
            "sentence1",
            text_pair_column="sentence2" if pairs else None,
        )
        self.split = split
        self.has_types = "token_type_ids" in split.column_names
        lengths = split["length"]
        batches = text.text_batches(
            split, global_batch=len(rows), boundaries=[max(lengths)], shuffle=False
        )
        # one batch: every example, in order
        self.bucketed, self.labels, _ = next(iter(batches.dataset()))
        self.width = packing.row_width(lengths, 32)
        self.rows = packing.pack_rows(lengths, self.width, max_per_row=4)
        assert any(len(r) > 1 for r in self.rows)
        types = split["token_type_ids"] if self.has_types else None
        pad = self.tokenizer.pad_token_id
        self.arrays = packing.packed_arrays(
            split["input_ids"], split["label"], self.rows, self.width, 4, pad, types
        )
        self.features = {
            k: tf.constant(v) for k, v in self.arrays.items() if k not in ("labels", "weights")
        }
        self.packed = packed_classes.PackedClassifier(self.model)

    def reference(self):
        """Logits of every example, from the model's own call on the bucketed batch."""
        return self.model(self.bucketed, training=False).logits.numpy()

    def largest_gap(self, features=None):
        """The largest difference between a packed example's logits and its own."""
        logits = self.packed(features or self.features).numpy()
        reference = self.reference()
        return max(
            np.abs(logits[r, slot] - reference[index]).max()
            for r, row in enumerate(self.rows)
            for slot, index in enumerate(row)
        )


@pytest.fixture(scope="module")
def family(family_checkpoints):
    cache = {}

    def get(name, pairs=True):
        if (name, pairs) not in cache:
            cache[name, pairs] = Family(family_checkpoints(name), pairs)
        return cache[name, pairs]

    return get


@pytest.mark.parametrize("pairs", [False, True], ids=["single", "pairs"])
@pytest.mark.parametrize("name", families.PACKED)
def test_packed_logits_equal_the_models_own_on_the_bucketed_batch(family, name, pairs):
    case = family(name, pairs)
    if pairs:  # the tokenizer's own pair template, and token types where the model has them
        ids = case.split["input_ids"][0]
        assert ids.count(case.tokenizer.sep_token_id) >= 2
        assert case.has_types == ("token_type_ids" in case.tokenizer.model_input_names)
        if case.has_types:
            assert 1 in case.arrays["token_type_ids"]
    assert case.largest_gap() < 2e-5


@pytest.mark.parametrize("name", families.PACKED)
def test_packed_gradients_equal_the_unpacked_ones(family, name):
    case = family(name)
    model, arrays = case.model, case.arrays
    with tf.GradientTape() as tape:
        loss = packed_classes.packed_loss(
            arrays["labels"], case.packed(case.features), arrays["weights"]
        )
    ours = tape.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as tape:
        logits = model(case.bucketed, training=False).logits
        reference = tf.reduce_mean(
            tf.keras.losses.sparse_categorical_crossentropy(case.labels, logits, from_logits=True)
        )
    theirs = tape.gradient(reference, model.trainable_variables)
    np.testing.assert_allclose(float(loss), float(reference), rtol=1e-5)
    compared = 0
    for variable, a, b in zip(model.trainable_variables, ours, theirs, strict=True):
        if b is None:  # e.g. the BERT pooler of an unused branch
            assert a is None or not np.any(tf.convert_to_tensor(a)), variable.name
            continue
        compared += 1
        np.testing.assert_allclose(
            tf.convert_to_tensor(a),
            tf.convert_to_tensor(b),
            atol=2e-6,
            rtol=1e-4,
            err_msg=variable.name,
        )
    assert compared > 10


@pytest.mark.parametrize("name", families.PACKED)
def test_an_example_never_sees_its_neighbours(family, name):
    case = family(name)
    before = case.packed(case.features).numpy()
    r = next(i for i, row in enumerate(case.rows) if len(row) > 1)
    changed = dict(case.features)
    ids = case.arrays["input_ids"].copy()
    ids[r][case.arrays["segment_ids"][r] == 2] = 7  # every token of the row's second example
    changed["input_ids"] = tf.constant(ids)
    after = case.packed(changed).numpy()
    np.testing.assert_allclose(after[r, 0], before[r, 0], atol=1e-6)  # its neighbour: same
    assert np.abs(after[r, 1] - before[r, 1]).max() > 1e-4  # itself: moved


@pytest.mark.parametrize("name", families.PACKED)
def test_the_comparison_fails_a_leaking_mask_and_unrestarted_positions(family, name, monkeypatch):
    """The equality above is not vacuous: each of the two ways packing goes wrong breaks it."""
    case = family(name)
    assert case.largest_gap() < 2e-5
    row_positions = np.broadcast_to(np.arange(case.width), case.arrays["position_ids"].shape)
    unrestarted = dict(case.features, position_ids=tf.constant(row_positions, tf.int32))
    assert case.largest_gap(unrestarted) > 1e-2
    # every real token may attend to every real token of its row
    monkeypatch.setattr(
        packed_classes,
        "same_example",
        lambda s: tf.logical_and(s[:, :, None] >= 0, s[:, None, :] > 0),
    )
    assert case.largest_gap() > 1e-2


def test_an_unbuilt_model_is_built_by_its_own_call_first():
    from transformers import TFAutoModelForSequenceClassification

    from tpu_helpers.teaching.fixtures import tiny_config

    config = tiny_config("bert", 100, 0, 3, **SENSITIVE)
    model = TFAutoModelForSequenceClassification.from_config(config)
    assert not model.built
    packed = packed_classes.PackedClassifier(model)
    weights = len(model.weights)
    rows, features, _ = packed_batch(EXAMPLES, LABELS)
    logits = packed(features).numpy()
    for r, row in enumerate(rows):
        for slot, index in enumerate(row):
            np.testing.assert_allclose(logits[r, slot], alone(model, EXAMPLES[index]), atol=2e-5)
    assert len(model.weights) == weights  # the model's own call made no second set


def test_other_families_and_mixing_convolutions_are_refused():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="covers albert, bert"):
        packed_classes.PackedClassifier(SimpleNamespace(config=SimpleNamespace(model_type="gpt2")))
    conv = SimpleNamespace(model_type="deberta-v2", conv_kernel_size=3)
    assert "convolution" in packed_classes.unsupported_reason(conv)
    assert packed_classes.unsupported_reason(SimpleNamespace(model_type="deberta-v2")) is None


def test_row_width_holds_the_longest_example():
    assert packing.row_width([10, 30, 64], 64) == 64
    assert packing.row_width([10, 82], 64) == 88  # the next multiple of 8
    assert packing.row_width([5], 64) == 64


def test_the_packed_model_saves_and_loads_as_an_ordinary_checkpoint(tmp_path):
    from transformers import TFAutoModelForSequenceClassification

    model = tiny_model("bert")
    _, features, _ = packed_batch(EXAMPLES, LABELS)
    before = packed_classes.PackedClassifier(model)(features).numpy()
    model.save_pretrained(str(tmp_path))
    reloaded = tf_classes.from_pretrained(TFAutoModelForSequenceClassification, str(tmp_path))
    np.testing.assert_allclose(
        packed_classes.PackedClassifier(reloaded)(features), before, atol=1e-6
    )
    np.testing.assert_allclose(
        reloaded(input_ids=tf.constant([EXAMPLES[0]])).logits[0],
        alone(model, EXAMPLES[0]),
        atol=1e-6,
    )


def test_the_packed_forward_pass_compiles_with_xla():
    from tpu_helpers.tf_engine import xla

    model = tiny_model("bert")
    _, features, _ = packed_batch(EXAMPLES, LABELS)
    packed = packed_classes.PackedClassifier(model)
    hlo = xla.compiled_hlo(lambda f: packed(f), features)
    assert not xla.dynamic_shape_ops(hlo)
    if xla.xla_target().runs:
        out = xla.compile_and_run(lambda f: packed(f), features)
        np.testing.assert_allclose(out, packed(features), atol=1e-5)


def test_packed_batches_use_every_example_once_at_one_shape():
    from tpu_helpers.data.shapes import shape_report

    examples = [list(RNG.integers(5, 99, size=n)) for n in RNG.integers(2, 20, size=37)]
    labels = list(RNG.integers(0, 3, size=37))
    plan = packing.packed_batches(
        examples, labels, width=24, global_batch=4, epochs=1, max_per_row=4, seed=3
    )
    steps = plan.steps_per_epoch
    ds = plan.dataset()
    batches = list(ds)
    assert len(batches) == steps == int(ds.cardinality())
    assert (plan.global_batch, plan.examples, plan.max_width) == (4, len(examples), 24)
    report = plan.padding
    assert report.examples == len(examples) and report.real_tokens == sum(map(len, examples))
    assert report.rows <= steps * 4 < report.rows + 4
    shapes = shape_report(plan, n=steps)
    assert shapes.distinct == 1 and shapes.batches == steps
    real = sum(len(e) for e in examples)
    assert shapes.padding_fraction == pytest.approx(1 - real / (steps * 4 * 24))
    seen = []
    for features, y, w in batches:
        ids, seg = features["input_ids"].numpy(), features["segment_ids"].numpy()
        for r in range(ids.shape[0]):
            for slot in range(4):
                if w[r, slot] > 0:
                    seen.append((tuple(ids[r][seg[r] == slot + 1]), int(y[r, slot])))
    assert sorted(seen) == sorted((tuple(e), int(y)) for e, y in zip(examples, labels, strict=True))
    two = packing.packed_batches(
        examples, labels, width=24, global_batch=4, epochs=2, max_per_row=4, seed=3
    )
    steps2 = two.steps_per_epoch
    epochs = [list(two.dataset(e)) for e in range(2)]
    assert [len(e) for e in epochs] == [steps2] * 2 and steps2 >= steps
    for epoch in epochs:  # each epoch: every example once
        assert sum(float(w.numpy().sum()) for _, _, w in epoch) == len(examples)
    first, second = (np.concatenate([b[0]["input_ids"].numpy() for b in e]) for e in epochs)
    assert not np.array_equal(first, second)  # packed and ordered anew
    with pytest.raises(ValueError, match="epoch=2: the packing was planned for 2 epochs"):
        two.dataset(2)
    with pytest.raises(ValueError, match=f"skip_steps={steps2 + 1}: an epoch of packed batches"):
        two.dataset(1, skip_steps=steps2 + 1)
    with pytest.raises(ValueError, match=f"skip_steps={steps2} is the end of epoch 1 of packed"):
        two.dataset(1, skip_steps=steps2)


@pytest.mark.parametrize("epoch", [0, 1])
def test_a_resumed_packed_epoch_is_the_tail_of_the_whole_one(epoch):
    """One epoch from a step on, as a resumed run asks: the same batches as the whole
    epoch's, whatever was read before (the other epoch, or nothing)."""
    examples = [list(RNG.integers(5, 99, size=n)) for n in RNG.integers(2, 20, size=37)]
    labels = list(RNG.integers(0, 3, size=37))

    def plan():
        return packing.packed_batches(
            examples, labels, width=24, global_batch=4, epochs=2, max_per_row=4, seed=3
        )

    whole_plan = plan()
    list(whole_plan.dataset(1 - epoch))  # the other epoch read first changes nothing
    whole = list(whole_plan.dataset(epoch))
    assert len(whole) == len(list(whole_plan.dataset(epoch))) == whole_plan.steps_per_epoch
    weights = sum(float(w.numpy().sum()) for _, _, w in whole)
    assert weights == len(examples)  # every example once with weight 1, fillers 0
    resumed_plan = plan()  # a new process, resumed
    for skip in range(1, whole_plan.steps_per_epoch):
        part = list(resumed_plan.dataset(epoch, skip_steps=skip))
        assert len(part) == whole_plan.steps_per_epoch - skip
        for got, want in zip(part, whole[skip:], strict=True):
            for name in want[0]:
                np.testing.assert_array_equal(got[0][name], want[0][name])
            np.testing.assert_array_equal(got[1], want[1])
            np.testing.assert_array_equal(got[2], want[2])


def test_fit_trains_the_wrapped_model_on_packed_batches():
    model = tiny_model("bert")
    examples = EXAMPLES * 8
    plan = packing.packed_batches(
        examples, LABELS * 8, width=24, global_batch=4, epochs=1, max_per_row=3
    )
    packed = packed_classes.packed_keras_model(model)
    packed.compile(optimizer=tf.keras.optimizers.Adam(1e-2))
    ds = plan.dataset().repeat()
    history = packed.fit(ds, epochs=12, steps_per_epoch=plan.steps_per_epoch, verbose=0).history
    assert history["loss"][-1] < history["loss"][0] * 0.7, history["loss"]
    assert history["accuracy"][-1] > 0.6
    # the wrapped (unpacked) model learned it: it classifies the examples alone too
    predicted = [int(np.argmax(alone(model, e))) for e in EXAMPLES]
    assert np.mean(np.array(predicted) == np.array(LABELS)) > 0.6


def test_preflight_passes_a_packed_model_and_reads_its_padding_from_segment_ids():
    from tpu_helpers.tf_engine import xla

    model = tiny_model("roberta")
    plan = packing.packed_batches(
        EXAMPLES * 4, LABELS * 4, width=24, global_batch=4, epochs=1, max_per_row=3, pad_token_id=1
    )
    report = xla.preflight(
        model, plan, batches=2, train_step=packed_classes.packed_train_step(model)
    )
    text = str(report)
    print(text)
    assert "1 distinct shape(s)" in text
    padding = next(line for line in text.splitlines() if "padding" in line and "%" in line)
    assert padding.startswith("PASS")
    assert "compiles with XLA" in text


def test_rows_per_replica_keeps_the_examples_per_step():
    lengths = [10] * 30 + [30] * 10  # mean 15
    assert packing.rows_per_replica(lengths, 16, 60) == 4  # 4 rows of ~4 examples
    assert packing.rows_per_replica(lengths, 16, 128) == 2
    assert packing.rows_per_replica([100], 1, 128) == 1  # never 0


def _page_best_fit_rows():
    """Notebook 07's ``best_fit_rows``, run from the notebook's own cell (not a copy)."""
    from pages import page_function

    return page_function("07_packed_fine_tuning.ipynb", "best_fit_rows", np=np)


@pytest.mark.parametrize("width,max_per_row", [(16, 2), (64, 16), (128, 5)])
def test_the_helpers_packing_is_the_one_notebook_07_writes_on_its_page(width, max_per_row):
    lengths = np.random.default_rng(width).integers(1, width + 1, 500) // 2 + 1
    rows = packing.pack_rows(lengths, width, max_per_row, seed=None)
    assert rows == _page_best_fit_rows()(lengths, width, max_per_row)
    assert sorted(i for row in rows for i in row) == list(range(500))


@pytest.mark.parametrize("width,max_per_row", [(16, 2), (64, 16), (128, 5)])
def test_the_helpers_arrays_are_the_ones_notebook_07_writes_on_its_page(width, max_per_row):
    """Rows of one to max_per_row examples, a row filled to its width, pad id 1 (RoBERTa's):
    the page's ``packed_features`` and ``packing.packed_arrays`` give the same arrays."""
    from pages import page_function

    page = page_function("07_packed_fine_tuning.ipynb", "packed_features", np=np)
    rng = np.random.default_rng(width)
    lengths = rng.integers(1, width + 1, 300) // 2 + 1
    token_ids = [rng.integers(2, 500, n).tolist() for n in lengths]
    labels = rng.integers(0, 3, 300).tolist()
    rows = packing.pack_rows(lengths, width, max_per_row, seed=None)
    ours = page(rows, token_ids, labels, width, max_per_row, 1)
    helper = packing.packed_arrays(token_ids, labels, rows, width, max_per_row, 1)
    assert set(ours) == set(helper)
    for key in helper:
        np.testing.assert_array_equal(ours[key], helper[key], err_msg=key)
    assert (helper["input_ids"] == 1).any()  # padding, in the pad id given
    assert max_per_row == 2 or (helper["weights"] == 0).any()  # empty slots too
