"""Packed fine-tuning on the Keras 3 engine (``keras3.packed_classifier``): several examples
per row, each computing what it computes alone, on KerasHub's layers over 8 simulated
devices. The tiny classifiers of ``build/fixtures/engines/<family>`` and their reference
batch (8 examples, their own widths) are the examples. These tests run on the Keras 3
stacks (``STACK=keras3``, ``colab``) and are skipped where KerasHub is not installed.
"""

import json
import os

import numpy as np
import pytest

if os.environ.get("STACK") in ("keras3", "colab"):
    import keras_hub  # (the Keras 3 legs must not skip these)
else:
    keras_hub = pytest.importorskip("keras_hub")

from conftest import CompileLog  # noqa: E402

from tpu_helpers import keras3
from tpu_helpers.core.errors import EngineError  # noqa: E402
from tpu_helpers.core.families import KERAS3_PACKED  # noqa: E402
from tpu_helpers.data import packing  # noqa: E402
from tpu_helpers.teaching.fixtures import ENGINE_LEARNING_RATE  # noqa: E402

DISTRIBUTION = keras3.connect(8)
import keras  # noqa: E402

#: float32, relative to the largest logit: the same function computed in another order.
TOLERANCE = 1e-5
#: after one SGD step of 0.5, as the engines' equality tests allow (tests/test_keras3.py)
AFTER_STEP_TOLERANCE = 1e-4


def reference_examples(fixtures_dir, family):
    """The reference batch's features, and each example alone (its real tokens)."""
    ref = np.load(fixtures_dir / "engines" / family / "reference.npz")
    features = {k.removeprefix("feature_"): ref[k] for k in ref.files if k.startswith("feature_")}
    real = features["attention_mask"] > 0
    examples = [list(ids[keep]) for ids, keep in zip(features["input_ids"], real, strict=True)]
    types = None
    if "token_type_ids" in features:
        types = [list(t[keep]) for t, keep in zip(features["token_type_ids"], real, strict=True)]
    return features, ref, examples, types


def packed(examples, types, labels, rows_at_least=0, per_row=4):
    """The examples packed into rows of twice the longest (several a row), completed with
    empty rows (every weight 0) to ``rows_at_least``; and the rows' example indices."""
    lengths = [len(e) for e in examples]
    width = packing.row_width(lengths, 2 * max(lengths))
    rows = packing.pack_rows(lengths, width, max_per_row=per_row)
    arrays = packing.packed_arrays(examples, labels, rows, width, per_row, 0, types)
    return packing._filled(arrays, max(rows_at_least, len(rows)), 0), rows


def features_of(arrays):
    return {k: v for k, v in arrays.items() if k not in ("labels", "weights", "position_ids")}


def largest_gap(packed_logits, rows, own_logits) -> float:
    """The largest difference between a packed example's logits and its own, relative to
    the largest logit."""
    gaps = [
        np.abs(packed_logits[r, slot] - own_logits[i]).max()
        for r, row in enumerate(rows)
        for slot, i in enumerate(row)
    ]
    return float(max(gaps) / max(1.0, np.abs(own_logits).max()))


@pytest.mark.parametrize("family", KERAS3_PACKED)
def test_each_packed_example_gets_the_logits_it_gets_alone(fixtures_dir, family):
    """Several examples a row (sentence pairs with their token types for BERT and ALBERT):
    each slot's logits are the example's own, unpacked, in float32."""
    features, _, examples, types = reference_examples(fixtures_dir, family)
    model = keras3.classifier(fixtures_dir / "engines" / family, verbose=False)
    arrays, rows = packed(examples, types, [0] * len(examples))
    assert max(len(row) for row in rows) > 1, rows  # some rows hold several examples
    packed_model = keras3.packed_classifier(model)
    logits = np.asarray(packed_model(features_of(arrays)))
    assert logits.shape == (len(rows), 4, model.network.outputs[0].shape[-1])
    assert largest_gap(logits, rows, np.asarray(model(features))) < TOLERANCE
    # no weight of its own: training it trains the model (notebook 07 checks the same)
    assert {w.path for w in packed_model.weights} <= {w.path for w in model.weights}


def test_in_bfloat16_packed_examples_get_what_they_get_alone_in_bfloat16(fixtures_dir):
    """Under ``mixed_bfloat16`` (the notebooks' default on a TPU) the packed model computes
    in bfloat16 and returns float32 logits close to the unpacked model's in bfloat16: the
    same roundings of the same numbers, other sums (the mask changes none)."""
    features, _, examples, types = reference_examples(fixtures_dir, "bert")
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = keras3.classifier(fixtures_dir / "engines" / "bert", verbose=False)
        arrays, rows = packed(examples, types, [0] * len(examples))
        packed_model = keras3.packed_classifier(model)
        logits = packed_model(features_of(arrays))
        own = np.asarray(model(features))
    finally:
        keras.config.set_dtype_policy("float32")
    assert str(logits.dtype) == "float32"
    assert any("bfloat16" in str(layer.compute_dtype) for layer in packed_model.network.layers)
    assert largest_gap(np.asarray(logits), rows, own) < 0.05  # 8 bits of mantissa


def test_a_kerashub_that_builds_its_encoders_otherwise_is_refused_naming_it(
    fixtures_dir, monkeypatch
):
    """The packed model rests on KerasHub calling one ``TransformerEncoder`` per layer and
    one position embedding; a release that does otherwise is refused, not packed wrong."""
    model = keras3.classifier(fixtures_dir / "engines" / "distilbert", verbose=False)
    monkeypatch.setattr(keras_hub.layers, "TransformerEncoder", type("Other", (), {}))
    with pytest.raises(EngineError, match="this KerasHub builds its encoders differently"):
        keras3.packed_classifier(model)


@pytest.mark.parametrize("wrong", ["mask", "positions"])
def test_a_mask_that_lets_examples_see_each_other_or_positions_that_run_on_are_caught(
    fixtures_dir, monkeypatch, wrong
):
    """What the equality above rests on: with every token of a row seeing every other, or
    positions counted along the row instead of restarting, the packed logits differ."""
    features, _, examples, types = reference_examples(fixtures_dir, "bert")
    ops = keras.ops
    if wrong == "mask":
        monkeypatch.setattr(
            keras3.packed,
            "packed_attention",
            lambda s: ops.expand_dims(ops.ones_like(s) > 0, 1) & (ops.expand_dims(s, 1) > 0),
        )
    else:
        monkeypatch.setattr(
            keras3.packed, "packed_positions", lambda s: ops.cumsum(ops.ones_like(s), 1) - 1
        )
    model = keras3.classifier(fixtures_dir / "engines" / "bert", verbose=False)
    arrays, rows = packed(examples, types, [0] * len(examples))
    logits = np.asarray(keras3.packed_classifier(model)(features_of(arrays)))
    assert largest_gap(logits, rows, np.asarray(model(features))) > 100 * TOLERANCE


@pytest.mark.parametrize("family", ["bert", "distilbert", "roberta"])
def test_a_packed_step_trains_the_classifier_as_the_unpacked_step_does(fixtures_dir, family):
    """One SGD step on the 8 examples packed (``compile_classifier`` on the packed model:
    the loss averaged over the weighted slots, empty rows weighing 0) moves the classifier's
    weights as one step on the same examples unpacked: the same loss and logits after."""
    features, ref, examples, types = reference_examples(fixtures_dir, family)
    arrays, _ = packed(examples, types, list(ref["labels"]), rows_at_least=8)

    unpacked = keras3.classifier(fixtures_dir / "engines" / family, verbose=False)
    keras3.compile_classifier(unpacked, 0, optimizer=keras.optimizers.SGD(ENGINE_LEARNING_RATE))
    want = unpacked.train_on_batch(features, ref["labels"], return_dict=True)["loss"]

    model = keras3.classifier(fixtures_dir / "engines" / family, verbose=False)
    packed_model = keras3.packed_classifier(model)
    keras3.compile_classifier(packed_model, 0, optimizer=keras.optimizers.SGD(ENGINE_LEARNING_RATE))
    got = packed_model.train_on_batch(
        features_of(arrays), arrays["labels"], sample_weight=arrays["weights"], return_dict=True
    )["loss"]
    assert got == pytest.approx(want, rel=1e-5)
    after = np.asarray(unpacked(features))
    gap = np.abs(np.asarray(model(features)) - after).max() / max(1.0, np.abs(after).max())
    assert gap < AFTER_STEP_TOLERANCE


def _cola_packed(fixtures_dir, epochs, rows=160):
    from tpu_helpers.data import hub, text

    checkpoint = fixtures_dir / "tiny-distilbert"
    data = text.load_text_dataset(str(fixtures_dir / "cola"))
    tokenized = text.tokenize(data["train"].select(range(rows)), hub.load_tokenizer(checkpoint), 64)
    batches = packing.packed_batches(
        tokenized["input_ids"],
        tokenized["label"],
        width=64,
        global_batch=8,
        epochs=epochs,
        max_per_row=8,
        num_labels=2,
    )
    return checkpoint, batches


def test_packed_fine_tuning_stopped_mid_epoch_resumes_to_the_uninterrupted_weights(
    fixtures_dir, tmp_path
):
    """``fit_resumable`` on packed batches (dropout on, two steps a call): one compiled
    shape for the whole run and nothing compiled after the first epoch (JAX's own compile
    log), the epoch line counting each packed example once, and
    a run stopped between two saves and started again ends with the uninterrupted run's
    weights: every step's rows are the same."""
    checkpoint, batches = _cola_packed(fixtures_dir, epochs=2)
    assert batches.steps_per_epoch >= 4

    def trained(folder, stop_after=None, more=()):
        model = keras3.classifier(checkpoint, num_labels=2, verbose=False)
        packed_model = keras3.packed_classifier(model)
        keras3.compile_classifier(packed_model, 1e-3, steps_per_execution=2)

        class Stop(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if stop_after and batch + 1 >= stop_after:
                    raise KeyboardInterrupt  # a lost runtime, between two saves

        lines = []
        history = keras3.fit_resumable(
            packed_model,
            batches,
            2,
            str(folder),
            every_steps=2,
            callbacks=[Stop(), *more],
            log=lines.append,
        )
        return model, packed_model, history, lines

    compiled_by_epoch = []

    class Compiled(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            compiled_by_epoch.append(len(log.steps()))

    with CompileLog() as log:
        whole, packed_model, history, lines = trained(tmp_path / "whole", more=[Compiled()])
    assert compiled_by_epoch[0] >= 1 and compiled_by_epoch[1] == compiled_by_epoch[0], log.compiled
    assert len(history["loss"]) == 2 and history["loss"][1] < history["loss"][0]
    assert list(keras3.compilations(packed_model).values()) == [1]  # one shape, one compile
    epoch_line = next(line for line in lines if "epoch 1:" in line)
    assert f" {batches.examples} examples," in epoch_line, epoch_line  # each once, none twice
    with pytest.raises(KeyboardInterrupt):
        trained(tmp_path / "cut", stop_after=3)
    latest = json.loads((tmp_path / "cut" / "latest.json").read_text())
    assert (latest["epoch"], latest["step"]) == (0, 2), latest
    resumed, *_ = trained(tmp_path / "cut")
    for a, b in zip(whole.weights, resumed.weights, strict=True):
        np.testing.assert_allclose(np.asarray(b.value), np.asarray(a.value), rtol=1e-5, atol=1e-6)


def test_models_that_cannot_be_packed_are_refused_with_the_fix(fixtures_dir):
    image_model = keras3.classifier(fixtures_dir / "engines" / "vit", verbose=False)
    with pytest.raises(EngineError, match="packed_classifier takes a keras3.classifier of"):
        keras3.packed_classifier(image_model)
    masked_lm = keras3.masked_lm(fixtures_dir / "engines" / "bert-mlm", verbose=False)
    with pytest.raises(EngineError, match=r"Fix: model = keras3.classifier\(checkpoint"):
        keras3.packed_classifier(masked_lm)
