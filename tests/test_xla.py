import numpy as np
import pytest
import tensorflow as tf

from tpu_helpers.data import hub
from tpu_helpers.data.shapes import shape_report
from tpu_helpers.tf_engine import tf_classes, xla
from tpu_helpers.tf_engine.xla import masked_sparse_crossentropy, tracing_count


def boolean_mask_loss(labels, logits):
    keep = labels >= 0
    return tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(
            labels[keep], logits[keep], from_logits=True
        )
    )


@pytest.mark.parametrize("seed", range(5))
def test_masked_loss_equals_the_boolean_mask_version(seed):
    rng = np.random.default_rng(seed)
    logits = tf.constant(rng.normal(size=(4, 9, 5)), tf.float32)
    labels = rng.integers(0, 5, (4, 9))
    labels[rng.random((4, 9)) < 0.4] = -100
    labels = tf.constant(labels)
    expected = boolean_mask_loss(labels, logits)
    assert float(masked_sparse_crossentropy(labels, logits)) == pytest.approx(
        float(expected), rel=1e-5
    )
    # compiled where this build compiles: run on the CPU build, built for the TPU compiler
    # (with no value-dependent shape) by the TPU build off a TPU
    compiled = xla.compile_and_run(masked_sparse_crossentropy, labels, logits)
    if xla.xla_target().runs:
        assert float(compiled) == pytest.approx(float(expected), rel=1e-5)
    else:
        hlo = xla.compiled_hlo(masked_sparse_crossentropy, labels, logits)
        assert compiled is None and xla.dynamic_shape_ops(hlo) == []


def test_masked_loss_of_an_all_masked_batch_is_zero_not_nan():
    logits = tf.zeros((2, 3, 4))
    assert float(masked_sparse_crossentropy(tf.fill((2, 3), -100), logits)) == 0.0


def test_shape_report_counts_shapes_and_padding():
    def batch(width, real):
        mask = np.zeros((2, width), np.int32)
        mask[:, :real] = 1
        return {"input_ids": mask * 7, "attention_mask": mask}

    elements = [batch(8, 8), batch(16, 8), batch(8, 4)]
    ds = tf.data.Dataset.from_generator(
        lambda: iter(elements),
        output_signature={
            k: tf.TensorSpec((2, None), tf.int32) for k in ("input_ids", "attention_mask")
        },
    )
    rep = shape_report(ds, n=10)
    assert rep.batches == 3 and rep.distinct == 2
    assert rep.counts["attention_mask[2, 8], input_ids[2, 8]"] == 2
    assert rep.padding_fraction == pytest.approx(1 - (16 + 16 + 8) / (16 + 32 + 16))
    assert "2 distinct input shape(s) in 3 batches" in str(rep)


def test_tracing_count_counts_retraces_per_shape():
    f = tf.function(lambda x: x * 2)
    for width in (8, 8, 16, 32, 16):
        f(tf.zeros((2, width)))
    assert tracing_count(f) == 3
    with pytest.raises(TypeError):
        tracing_count(lambda x: x)


def test_tracing_count_reads_a_keras_models_train_function():
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Lambda(lambda x: tf.reduce_mean(x, 1, keepdims=True)),
            tf.keras.layers.Dense(2),
        ]
    )
    model.compile("adam", "mse")
    with pytest.raises(ValueError, match="call fit first"):
        tracing_count(model)
    y = np.zeros((8, 2), np.float32)
    model.fit(np.zeros((8, 3), np.float32), y, batch_size=4, epochs=2, verbose=0)
    first = tracing_count(model)
    model.fit(np.zeros((8, 3), np.float32), y, batch_size=4, epochs=2, verbose=0)
    assert tracing_count(model) == first >= 1  # same shapes: no new trace
    model.fit(np.zeros((8, 5), np.float32), y, batch_size=4, verbose=0)
    assert tracing_count(model) > first  # a new input width is traced again


# --- preflight -------------------------------------------------------------------------


class Replicas:
    """Stands in for a strategy: preflight only reads num_replicas_in_sync."""

    def __init__(self, n):
        self.num_replicas_in_sync = n


def tiny_model():
    inputs = tf.keras.Input((None,), dtype=tf.int32, name="input_ids")
    x = tf.keras.layers.Embedding(50, 8)(inputs)
    x = tf.keras.layers.GlobalAveragePooling1D()(x)
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(2)(x))
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def token_batches(n=64, width=16, batch=8, drop_remainder=True):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50, (n, width)).astype(np.int32)
    ds = tf.data.Dataset.from_tensor_slices(({"input_ids": ids}, (np.arange(n) % 2)))
    return ds.batch(batch, drop_remainder=drop_remainder)


def test_preflight_passes_a_tpu_ready_setup():
    report = xla.preflight(tiny_model(), token_batches(), Replicas(8))
    assert report.ok and "ready for a TPU" in str(report)
    assert {c.name for c in report.checks} >= {
        "static batch size",
        "batch divides across replicas",
        "dtypes",
        "few input shapes",
        "compiles with XLA",
        "static shapes inside the step",
        "program independent of the data",
    }
    assert all(c.status == "PASS" for c in report.checks)


def test_preflight_passes_the_notebook_text_pipeline(fixtures_dir):
    from datasets import load_dataset
    from transformers import TFAutoModelForSequenceClassification

    from tpu_helpers.data import text

    tokenizer = hub.load_tokenizer(str(fixtures_dir / "tiny-distilbert"))
    split = text.tokenize(load_dataset(str(fixtures_dir / "cola"))["validation"], tokenizer, 128)
    batches = text.text_batches(
        split, global_batch=16, boundaries=text.padding_boundaries(split["length"], "buckets")
    )
    model = tf_classes.from_pretrained(
        TFAutoModelForSequenceClassification, str(fixtures_dir / "tiny-distilbert"), num_labels=2
    )
    report = xla.preflight(model, batches, Replicas(2), batches=10)
    assert report.ok, str(report)
    assert report["padding"].status == "PASS"


def test_preflight_names_a_missing_drop_remainder_and_raises():
    with pytest.raises(xla.PreflightError, match="static batch size.*\n.*drop_remainder=True"):
        xla.preflight(tiny_model(), token_batches(n=60, drop_remainder=False), compile_step=False)


def test_preflight_batch_that_does_not_divide_across_replicas():
    report = xla.preflight(
        tiny_model(),
        token_batches(batch=30),
        Replicas(8),
        compile_step=False,
        raise_on_failure=False,
    )
    check = report["batch divides across replicas"]
    assert check.status == "FAIL" and "30 % 8 = 6" in check.detail
    assert "multiple of 8" in check.fix


def test_preflight_refuses_strings_and_float64():
    ds = tf.data.Dataset.from_tensor_slices(
        ({"text": ["a", "b"] * 8, "score": np.ones(16, np.float64)}, np.zeros(16, np.int32))
    ).batch(4, drop_remainder=True)
    report = xla.preflight(None, ds, compile_step=False, raise_on_failure=False)
    assert report["dtypes"].status == "FAIL"
    assert "float64" in report["dtypes"].detail and "string" in report["dtypes"].detail


def test_preflight_counts_shapes_and_padding():
    def gen():
        rng = np.random.default_rng(0)
        for width in range(4, 20):  # padding to the longest row: a new width each batch
            ids = np.zeros((8, width), np.int32)
            ids[:, :2] = rng.integers(1, 50, (8, 2))
            yield {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int32)}, np.zeros(8)

    spec = (
        {
            "input_ids": tf.TensorSpec([8, None], tf.int32),
            "attention_mask": tf.TensorSpec([8, None], tf.int32),
        },
        tf.TensorSpec([8], tf.float64),
    )
    ds = tf.data.Dataset.from_generator(gen, output_signature=spec)
    report = xla.preflight(None, ds, compile_step=False, max_shapes=4, raise_on_failure=False)
    assert report["few input shapes"].status == "FAIL"
    assert report["few input shapes"].detail.startswith("16 distinct shape(s)")
    assert report["padding"].status == "WARN"


def _step_report(step):
    return xla.preflight(None, token_batches(), train_step=step, raise_on_failure=False)


def test_preflight_translates_an_op_xla_cannot_compile():
    def step(x, y):
        return tf.py_function(lambda a: a, [tf.cast(y, tf.float32)], tf.float32)

    check = _step_report(step)["compiles with XLA"]
    assert check.status == "FAIL" and "EagerPyFunc" in check.detail
    assert "tf.data pipeline" in check.fix


def test_preflight_translates_a_python_if_on_a_tensor():
    @tf.autograph.experimental.do_not_convert
    def step(x, y):
        if tf.reduce_sum(y) > 3:
            return tf.reduce_sum(y)
        return tf.constant(0, y.dtype)

    check = _step_report(step)["compiles with XLA"]
    assert check.status == "FAIL" and check.detail.startswith("rule 1")
    assert "tf.where" in check.fix


def test_preflight_finds_a_shape_that_depends_on_values():
    def step(x, y):  # the tutorial's boolean-mask loss
        logits = tf.one_hot(x["input_ids"][:, 0] % 2, 2)
        return boolean_mask_loss(
            tf.where(x["input_ids"][:, 1] > 25, -100, tf.cast(y, tf.int32)), logits
        )

    report = _step_report(step)
    check = report["static shapes inside the step"]
    assert check.status == "FAIL" and "Where" in check.detail, str(report)


def test_preflight_passes_the_masked_loss_version():
    def step(x, y):
        logits = tf.one_hot(x["input_ids"][:, 0] % 2, 2)
        return masked_sparse_crossentropy(
            tf.where(x["input_ids"][:, 1] > 25, -100, tf.cast(y, tf.int32)), logits
        )

    assert _step_report(step).ok


def test_preflight_finds_a_program_that_depends_on_values():
    def step(x, y):  # trims the batch to a width computed from the data
        width = x["input_ids"][0, 0] % 16 + 1  # differs between the first two batches
        return tf.reduce_sum(x["input_ids"][:, :width])

    report = _step_report(step)
    assert report["program independent of the data"].status == "FAIL", str(report)


def test_translate_xla_error_names_the_rule_and_op():
    err = ValueError("Input 1 to node `range` with op Range must be a compile-time constant.")
    rule, op, fix = xla.translate_xla_error(err)
    assert rule.startswith("rule 2") and op == "Range" and "mask" in fix
    rule, op, _ = xla.translate_xla_error(RuntimeError("something else entirely"))
    assert "could not compile" in rule and op == ""


def test_preflight_wants_the_undistributed_dataset():
    with pytest.raises(TypeError, match="pipeline.Batches.*or a tf.data.Dataset.*not list"):
        xla.preflight(None, [1, 2, 3])


runs_xla = pytest.mark.skipif(
    not xla.xla_target().runs,
    reason="this TensorFlow build runs no XLA step without a TPU (tensorflow-tpu: no host"
    " backend); the refusal itself is tested below",
)


@runs_xla
def test_notebook_05s_counting_pass_counts_one_compilation_per_shape_and_the_padding():
    """Notebook tf/05's ``train_counting_compiles`` and ``summary``, run from its page."""
    import time
    import types

    import pandas as pd
    from pages import page_function

    page = {"tf": tf, "pd": pd, "time": time}
    train = page_function("tf/05_xla_rules.ipynb", "train_counting_compiles", **page)
    summary = page_function("tf/05_xla_rules.ipynb", "summary", **page)

    def gen():
        for width in (8, 16, 8, 24, 16, 8):
            mask = np.zeros((4, width), np.int32)
            mask[:, : width // 2] = 1
            features = {"input_ids": np.ones((4, width), np.int32), "attention_mask": mask}
            yield features, np.zeros(4, np.int32), np.ones(4, np.float32)

    features = {k: tf.TensorSpec([4, None], tf.int32) for k in ("input_ids", "attention_mask")}
    spec = (features, tf.TensorSpec([4], tf.int32), tf.TensorSpec([4], tf.float32))
    ds = tf.data.Dataset.from_generator(gen, output_signature=spec)

    class Classifier(tf.keras.Model):  # a transformers-like output: .logits
        def __init__(self):
            super().__init__()
            self.embed, self.out = tf.keras.layers.Embedding(5, 4), tf.keras.layers.Dense(2)

        def call(self, features, training=False):
            pooled = tf.reduce_mean(self.embed(features["input_ids"]), axis=1)
            return types.SimpleNamespace(logits=self.out(pooled))

    model = Classifier()
    model({"input_ids": tf.ones((4, 8), tf.int32)})  # its weights, before the optimizer's
    steps = train(model, ds, tf.keras.optimizers.Adam(1e-3))
    assert list(steps.compiled) == [True, True, False, True, False, False]
    row = summary(steps)
    assert (row["steps"], row["distinct shapes"], row["compilations"]) == (6, 3, 3)
    assert row["padding share"] == 0.5
    assert steps.real[~steps.compiled].sum() == 4 * (4 + 8 + 4)  # reused a program


def test_shape_report_takes_a_dataset_or_a_list_of_batches():
    ds = token_batches(n=40, batch=8)
    from_dataset, from_list = shape_report(ds, n=3), shape_report(list(ds), n=3)
    assert from_dataset == from_list and from_list.batches == 3 and from_list.distinct == 1


def test_shape_report_and_preflight_read_the_first_epoch_of_a_pipeline():
    from tpu_helpers.core import pipeline

    ids = np.random.default_rng(0).integers(1, 50, (40, 16)).astype(np.int32)
    batches = pipeline.from_arrays({"input_ids": ids}, np.arange(40) % 2, global_batch=8)
    assert shape_report(batches, n=3) == shape_report(batches.dataset(0), n=3)
    report = xla.preflight(tiny_model(), batches, Replicas(8), compile_step=False)
    assert report.ok and report["static batch size"].status == "PASS"


def test_compiled_hlo_of_a_function_or_a_tf_function():
    x = tf.constant([1.0, -2.0, 3.0])
    plain = xla.compiled_hlo(lambda v: tf.reduce_sum(v * 2.0), x)
    compiled = xla.compiled_hlo(
        tf.function(lambda v: tf.boolean_mask(v, v > 0), jit_compile=True), x
    )
    assert plain.startswith("HloModule") and xla.dynamic_shape_ops(plain) == []
    assert "Where" in xla.dynamic_shape_ops(compiled)


# --- where XLA compiles ----------------------------------------------------------------
def test_xla_target_matches_the_tensorflow_build():
    from importlib import metadata

    target = xla.xla_target()
    try:
        metadata.version("tensorflow")
        cpu_build = True
    except metadata.PackageNotFoundError:
        cpu_build = False
    if cpu_build:  # the CPU build compiles and runs XLA on the processor
        assert (target.device, target.platform, target.runs) == ("/CPU:0", None, True)
    else:  # tensorflow-tpu off a TPU: no host backend, but the TPU compiler builds programs
        assert (target.device, target.platform, target.runs) == (None, "TPU", False)
        assert "host CPU" in target.note and target.can_compile


def test_compiled_hlo_is_built_where_the_target_says():
    hlo = xla.compiled_hlo(lambda v: tf.reduce_sum(v * 2.0), tf.ones([3]))
    assert hlo.startswith("HloModule")
    out = xla.compile_and_run(lambda v: tf.reduce_sum(v * 2.0), tf.ones([3]))
    if xla.xla_target().runs:
        assert float(out) == 6.0
    else:
        assert out is None


@pytest.fixture
def target_without_xla(monkeypatch):
    gone = xla.XlaTarget(None, None, "XLA cannot compile in this process: (stand-in)")
    monkeypatch.setattr(xla, "_TARGET", [gone])
    return gone


def test_preflight_says_skip_with_the_reason_where_nothing_compiles(target_without_xla):
    report = xla.preflight(tiny_model(), token_batches(), Replicas(8))
    assert report.ok  # a check that cannot run is not a failure ...
    check = report["compiles with XLA"]
    assert check.status == "SKIP" and "(stand-in)" in check.detail  # ... and says why
    assert "SKIP  compiles with XLA" in str(report) and "fix:" in check.line()


def test_preflight_names_an_unbatched_dataset():
    unbatched = token_batches().unbatch()
    with pytest.raises(xla.PreflightError, match="(?s)not batched.*drop_remainder=True"):
        xla.preflight(tiny_model(), unbatched, Replicas(8))
    report = xla.preflight(tiny_model(), unbatched, Replicas(8), raise_on_failure=False)
    assert not report.ok and report["batched"].status == "FAIL"


def test_preflight_fails_widths_beyond_the_models_positions(fixtures_dir):
    from datasets import load_dataset
    from transformers import DistilBertConfig, TFAutoModelForSequenceClassification

    from tpu_helpers.data import text

    tokenizer = hub.load_tokenizer(str(fixtures_dir / "tiny-distilbert"))
    split = text.tokenize(load_dataset(str(fixtures_dir / "cola"))["validation"], tokenizer, 128)
    batches = text.text_batches(split, global_batch=16, boundaries=[16, 64], shuffle=False)
    short = TFAutoModelForSequenceClassification.from_config(
        DistilBertConfig(
            vocab_size=tokenizer.vocab_size,
            dim=32,
            hidden_dim=64,
            n_layers=1,
            n_heads=2,
            max_position_embeddings=32,
        )
    )
    report = xla.preflight(
        short, batches, Replicas(2), batches=60, compile_step=False, raise_on_failure=False
    )
    assert report["positions"].status == "FAIL"
    assert "widest batch 64 tokens, the distilbert model embeds 32" in report["positions"].detail
    long = xla.preflight(
        short,
        text.text_batches(split, global_batch=16, boundaries=[16, 32]),
        Replicas(2),
        batches=60,
        compile_step=False,
        raise_on_failure=False,
    )
    assert long["positions"].status == "PASS"


def test_an_unknown_compile_error_shows_the_line_that_names_the_cause():
    error = ValueError(
        "Traceback (most recent call last):\n"
        '  File "model.py", line 12, in call\n'
        "Input 1 to node `range` with op Range must be a Tensor of known rank: Unsupported"
        " dynamic range in {{node deberta/attention/range}}\n"
        "  [[StatefulPartitionedCall]]\n"
        "Encountered when executing an operation using EagerExecutor. This error cancels"
        " all future operations and poisons their output tensors."
    )
    rule, op, fix = xla.translate_xla_error(error)
    assert rule.startswith("XLA could not compile the step")
    assert op == "Range"
    assert fix.startswith("Input 1 to node `range` with op Range") and "Unsupported" in fix


def test_preflight_takes_a_model_compiled_with_a_loss_by_name():
    """compile(loss="sparse_categorical_crossentropy") trains; its preflight must pass."""
    model = tiny_model()
    model.compile(loss="sparse_categorical_crossentropy")
    report = xla.preflight(model, token_batches(), Replicas(8), raise_on_failure=False)
    assert report.ok, str(report)


def test_preflight_error_carries_its_report_and_replicas_need_no_strategy():
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices((tf.zeros([60, 4]), tf.zeros([60], tf.int32))).batch(
        30
    )  # a batch of 30 for 8 replicas, and no static batch size
    with pytest.raises(xla.PreflightError) as caught:
        xla.preflight(model, data, replicas=8, compile_step=False)
    failed = {check.name for check in caught.value.report.failures}
    assert failed == {"static batch size", "batch divides across replicas"}
    assert str(caught.value) == str(caught.value.report)
    ok = xla.preflight(
        model, data.unbatch().batch(16, drop_remainder=True), replicas=8, compile_step=False
    )
    assert ok.ok and ok["batch divides across replicas"].status == "PASS"


def test_try_compile_prints_the_rule_a_failed_compilation_breaks(capsys):
    @tf.autograph.experimental.do_not_convert
    def python_if(x):
        if tf.reduce_sum(x) > 0:
            return x
        return -x

    assert not xla.try_compile(python_if, tf.constant([1.0]))
    said = capsys.readouterr().out
    assert "rule 1, no Python `if`/`while` on a tensor's value" in said and "-> fix:" in said
    assert xla.try_compile(lambda x: tf.where(tf.reduce_sum(x) > 0, x, -x), tf.constant([1.0]))


def test_preflight_names_ragged_features_as_such():
    """It blamed a value-dependent program (rules 1 and 2); a ragged column is named, with
    padding as the fix, and nothing is compiled."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, 50, n).tolist() for n in rng.integers(3, 20, 64)]
    ragged = tf.ragged.constant(rows, dtype=tf.int32)
    dataset = tf.data.Dataset.from_tensor_slices(({"input_ids": ragged}, np.arange(64) % 2))
    report = xla.preflight(
        tiny_model(), dataset.batch(8, drop_remainder=True), Replicas(8), raise_on_failure=False
    )
    assert [(c.name, c.status) for c in report.checks] == [("dense features", "FAIL")]
    assert "features['input_ids'] (ragged)" in str(report)
    assert "padded_batch" in str(report) and "to_tensor" in str(report)
    # padded to one width, the same rows pass
    padded = np.array([row + [0] * (20 - len(row)) for row in rows], np.int32)
    dataset = tf.data.Dataset.from_tensor_slices(({"input_ids": padded}, np.arange(64) % 2))
    assert xla.preflight(tiny_model(), dataset.batch(8, drop_remainder=True), Replicas(8)).ok
