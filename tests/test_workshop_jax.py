"""The main track's exercise checks refuse the wrong answers a learner writes (JAX, 8
simulated devices: the Keras 3 legs)."""

import os

import numpy as np
import pytest

if os.environ.get("STACK") in ("keras3", "colab"):
    import keras_hub  # noqa: F401  (the Keras 3 legs must not skip these)
else:
    pytest.importorskip("keras_hub")

from tpu_helpers import keras3
from tpu_helpers.keras3.steps import variable_values  # noqa: E402
from tpu_helpers.teaching import workshop_jax  # noqa: E402
from tpu_helpers.teaching.workshop import ExerciseCheckError  # noqa: E402

keras3.devices(8)  # before JAX starts: 8 simulated devices
import jax  # noqa: E402
import keras  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

jnp = jax.numpy


@pytest.fixture(scope="module")
def devices():
    found = jax.devices()
    assert len(found) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return found


def _placed(batch, devices, spec):
    return jax.device_put(batch, NamedSharding(Mesh(np.array(devices), ("batch",)), spec))


def test_a_batch_split_over_every_device_passes(devices, capsys):
    batch = np.arange(32).reshape(16, 2)
    workshop_jax.check_sharded_batch(
        _placed(batch, devices, PartitionSpec("batch")), batch, devices
    )
    assert "16 rows over 8 device(s), 2 on each" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda b, d: _placed(b, d, PartitionSpec()), "a copy of the whole batch"),
        (lambda b, d: _placed(b, d[:4], PartitionSpec("batch")), "on 4 device"),
        (lambda b, d: _placed(b[::-1].copy(), d, PartitionSpec("batch")), "not the batch"),
        (lambda b, d: b, "jax.device_put"),
        (lambda b, d: _placed(b[:8], d, PartitionSpec("batch")), "not the batch"),
    ],
    ids=["replicated", "half-the-devices", "another-order", "numpy", "half-the-rows"],
)
def test_a_batch_not_split_over_every_device_is_refused(devices, wrong, message):
    batch = np.arange(32).reshape(16, 2)
    with pytest.raises(ExerciseCheckError, match=message):
        workshop_jax.check_sharded_batch(wrong(batch, devices), batch, devices)


def test_the_filler_batch_makes_a_mean_of_means_wrong(devices):
    values, weights = workshop_jax.filler_batch(devices)
    v, w = np.asarray(values), np.asarray(weights)
    shards = zip(values.addressable_shards, weights.addressable_shards, strict=True)
    means = [np.sum(s.data * t.data) / np.sum(t.data) for s, t in shards]
    assert not np.isclose(np.mean(means), np.sum(v * w) / np.sum(w))
    assert w[-4:].tolist() == [1, 0, 0, 0] and w[:-3].all()


def test_the_weighted_mean_of_the_whole_batch_passes(devices, capsys):
    workshop_jax.check_global_mean(lambda v, w: jnp.sum(v * w) / jnp.sum(w), devices)
    assert "filler rows left out" in capsys.readouterr().out


def _mean_of_device_means(v, w):
    v, w = v.reshape(8, -1), w.reshape(8, -1)
    return jnp.mean(jnp.sum(v * w, axis=1) / jnp.sum(w, axis=1))


def _python_if(v, w):
    if jnp.sum(w) > 0:
        return jnp.sum(v * w) / jnp.sum(w)
    return 0.0


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda v, w: jnp.mean(v), "the filler rows count"),
        (lambda v, w: jnp.sum(v * w) / v.shape[0], "filler rows included"),
        (_mean_of_device_means, "a mean of each device's mean is not it"),
        (lambda v, w: v * w / jnp.sum(w), "one number for the batch"),
        (_python_if, "does not compile"),
        (lambda v, w: jnp.sum(v * w) / jnp.sum(undefined), "raised NameError"),  # noqa: F821
    ],
    ids=["unweighted", "by-rows", "mean-of-means", "per-row", "python-if", "broken"],
)
def test_a_wrong_weighted_mean_is_refused(devices, wrong, message):
    with pytest.raises(ExerciseCheckError, match=message):
        workshop_jax.check_global_mean(wrong, devices)


# --- 02: the training step and the fused steps ------------------------------------------
def _step(model, optimizer, weighted=True, training=True, keep_seeds=False):
    """The exercise's step, and the wrong ones a learner writes."""

    def train_step(state, batch):
        trainable, non_trainable, optimizer_variables = state
        features, labels, weights = batch

        def loss_of(trainable):
            logits, new = model.stateless_call(
                trainable, non_trainable, features, training=training
            )
            loss = model.loss(labels, logits, sample_weight=weights if weighted else None)
            return loss, non_trainable if keep_seeds else new

        (loss, new), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
        trainable, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return (trainable, new, optimizer_variables), loss

    return train_step


@pytest.fixture(scope="module")
def compiled(fixtures_dir):
    """A tiny DistilBERT compiled as notebook 02 compiles it, and a batch of 16 rows over
    the 8 devices whose last 5 rows are weight-0 filler."""
    model = keras3.classifier(fixtures_dir / "tiny-distilbert", num_labels=2, verbose=False)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.optimizer.build(model.trainable_variables)
    assert model.non_trainable_variables, "dropout seeds, for the checks of them"
    rng = np.random.default_rng(0)
    features = {
        "input_ids": rng.integers(5, 100, (16, 12)).astype("int32"),
        "attention_mask": np.ones((16, 12), "int32"),
    }
    labels = rng.integers(0, 2, 16).astype("int32")
    weights = (np.arange(16) < 11).astype("float32")
    split = NamedSharding(Mesh(np.array(jax.devices()), ("batch",)), PartitionSpec("batch"))
    batch = jax.device_put((features, labels, weights), split)
    return model, batch


def test_the_step_of_fit_written_out_passes(compiled, capsys):
    model, batch = compiled
    workshop_jax.check_train_step(_step(model, model.optimizer), model, batch)
    assert "one step equals fit's on 16 rows (5 filler)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, message",
    [
        (dict(weighted=False), "the filler rows .weight 0. change the step"),
        (dict(keep_seeds=True), "the dropout seeds did not move"),
        (dict(training=False), "the dropout seeds did not move"),
    ],
    ids=["filler-rows-count", "seeds-kept", "no-dropout"],
)
def test_a_step_that_is_not_fits_is_refused(compiled, wrong, message):
    model, batch = compiled
    with pytest.raises(ExerciseCheckError, match=message):
        workshop_jax.check_train_step(_step(model, model.optimizer, **wrong), model, batch)


def test_a_loss_divided_by_the_real_rows_is_not_fits(compiled):
    """fit's loss divides by the rows of the batch (the seeds' global batch), not by the
    sum of the weights: the last batch's step would be larger."""
    model, batch = compiled

    def by_real_rows(state, batch):
        features, labels, weights = batch
        new, loss = _step(model, model.optimizer)(state, (features, labels, weights * 16 / 11))
        return new, loss

    with pytest.raises(ExerciseCheckError, match="differ from fit's step"):
        workshop_jax.check_train_step(by_real_rows, model, batch)


def test_fused_steps_equal_the_steps_one_by_one_and_wrong_fusions_are_refused(compiled, capsys):
    model, batch = compiled
    step = _step(model, model.optimizer)
    state = jax.device_put(
        variable_values(model),
        NamedSharding(Mesh(np.array(jax.devices()), ("batch",)), PartitionSpec()),
    )
    stack = jax.tree.map(lambda a: jnp.stack([a, a, a]), batch)
    workshop_jax.check_train_steps(
        jax.jit(lambda s, b: jax.lax.scan(step, s, b)), step, state, stack
    )
    assert "3 steps in one call" in capsys.readouterr().out

    def last_loss_only(state, stack):
        new, losses = jax.lax.scan(step, state, stack)
        return new, losses[-1]

    def once(state, stack):  # the first batch only, its loss three times
        new, loss = step(state, jax.tree.map(lambda a: a[0], stack))
        return new, jnp.stack([loss] * 3)

    with pytest.raises(ExerciseCheckError, match="one loss a step"):
        workshop_jax.check_train_steps(last_loss_only, step, state, stack)
    with pytest.raises(ExerciseCheckError, match="are not those of the 3 steps in order"):
        workshop_jax.check_train_steps(once, step, state, stack)


# --- 05: the XLA rules on JAX ---------------------------------------------------------
def _count_if(ids):
    if np.sum(ids) > 100:
        return np.sum(ids != 0)
    return 0


IDS = [np.array([[101, 2023, 2003, 102, 0]]), np.array([[5, 3, 0]]), np.array([[60, 40, 0]])]


def test_a_count_with_where_passes(capsys):
    workshop_jax.check_same_values_jitted(
        lambda ids: jnp.where(jnp.sum(ids) > 100, jnp.sum(ids != 0), 0), _count_if, IDS
    )
    assert "jax.jit compiles it" in capsys.readouterr().out


def _python_if_count(ids):
    if jnp.sum(ids) > 100:
        return jnp.sum(ids != 0)
    return 0


@pytest.mark.parametrize(
    "wrong, message",
    [
        (_python_if_count, "cannot trace it.*jnp.where"),
        (lambda ids: jnp.where(jnp.sum(ids) >= 100, jnp.sum(ids != 0), 0), r"\[\[60, 40, 0\]\]"),
        (lambda ids: jnp.sum(ids != 0), r"for input \[\[5, 3, 0\]\]"),
    ],
    ids=["python-if", "greater-or-equal", "no-condition"],
)
def test_a_wrong_count_is_refused(wrong, message):
    with pytest.raises(ExerciseCheckError, match=message):
        workshop_jax.check_same_values_jitted(wrong, _count_if, IDS)


def _log_probs(logits):
    return jax.nn.log_softmax(logits)


def _static(labels, logits):
    keep = labels != -100
    picked = jnp.take_along_axis(_log_probs(logits), jnp.where(keep, labels, 0)[..., None], -1)
    return -jnp.sum(picked[..., 0] * keep) / jnp.maximum(jnp.sum(keep), 1)


def test_a_static_masked_loss_passes(capsys):
    workshop_jax.check_static_loss_jitted(_static)
    assert "an all -100 batch gives 0" in capsys.readouterr().out


def _boolean_indexing(labels, logits):
    keep = labels != -100
    return -jnp.mean(jnp.take_along_axis(_log_probs(logits[keep]), labels[keep][:, None], -1))


def _all_positions(labels, logits):
    keep = labels != -100
    picked = jnp.take_along_axis(_log_probs(logits), jnp.where(keep, labels, 0)[..., None], -1)
    return -jnp.mean(picked[..., 0] * keep)


def _unguarded(labels, logits):
    keep = labels != -100
    picked = jnp.take_along_axis(_log_probs(logits), jnp.where(keep, labels, 0)[..., None], -1)
    return -jnp.sum(picked[..., 0] * keep) / jnp.sum(keep)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (_boolean_indexing, "cannot trace it.*weight it 0 or 1"),
        (_all_positions, "with some labels -100 the loss"),
        (_unguarded, "every label -100 gives nan"),
    ],
    ids=["boolean-indexing", "mean-over-all", "unguarded"],
)
def test_a_wrong_masked_loss_is_refused(wrong, message):
    with pytest.raises(ExerciseCheckError, match=message):
        workshop_jax.check_static_loss_jitted(wrong)


def test_the_reference_loss_is_the_mean_over_the_kept_positions():
    logits = np.log(np.array([[[0.5, 0.5], [0.9, 0.1]]]))
    assert np.isclose(workshop_jax.masked_loss_reference([[0, -100]], logits), np.log(2))
    assert workshop_jax.masked_loss_reference([[-100, -100]], logits) == 0.0


@pytest.mark.parametrize("count", [1, 8], ids=["1-device", "8-devices"])
def test_the_custom_loops_weights_after_steps_equal_fits(compiled, count):
    """Three steps of the notebook's loop (its step, fused with scan) from the same start
    give the weights of three steps of fit's own step, on one device and on eight, in
    float32; with the filler rows counted they do not."""
    model, batch = compiled
    mesh = Mesh(np.array(jax.devices()[:count]), ("batch",))
    host = jax.device_get(batch)
    batch = jax.device_put(host, NamedSharding(mesh, PartitionSpec("batch")))
    state = jax.device_put(variable_values(model), NamedSharding(mesh, PartitionSpec()))
    stack = jax.tree.map(lambda a: jnp.stack([a, a, a]), batch)
    ours, _ = jax.jit(lambda s, b: jax.lax.scan(_step(model, model.optimizer), s, b))(state, stack)
    fits = state
    for _ in range(3):
        fits = workshop_jax._fits_step(model, fits, batch)
    assert workshop_jax._differs(ours, fits) is None
    counted = _step(model, model.optimizer, weighted=False)
    wrong, _ = jax.jit(lambda s, b: jax.lax.scan(counted, s, b))(state, stack)
    assert workshop_jax._differs(wrong, fits) == "the trainable weights differ"


_right_timing = workshop_jax._timed_right  # the check's own timing: waits, per call


def test_a_timing_that_waits_for_the_device_passes(capsys):
    workshop_jax.check_timing(_right_timing)
    assert "OK  exercise 09.2" in capsys.readouterr().out


def _not_waiting(step, args, calls):
    import time

    step(*args)
    start = time.perf_counter()
    for _ in range(calls):
        step(*args)
    return (time.perf_counter() - start) / calls


def _whole_time(step, args, calls):
    return _right_timing(step, args, calls) * calls


@pytest.mark.parametrize(
    "wrong, message",
    [
        (_not_waiting, "jax.block_until_ready"),
        (_whole_time, "divide the time"),
        (lambda step, args, calls: step(args), "raised"),
    ],
)
def test_a_timing_that_does_not_wait_or_is_not_per_call_is_refused(wrong, message):
    with pytest.raises(ExerciseCheckError, match=message):
        workshop_jax.check_timing(wrong)


class _Compiled:
    """What check_masked_lm_loss reads of a compiled model."""

    def __init__(self, loss):
        self.loss, self.optimizer = loss, keras.optimizers.AdamW(1e-3)


def test_the_masked_lm_loss_over_the_masked_tokens_passes(capsys):
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"
    )
    workshop_jax.check_masked_lm_loss(_Compiled(loss))
    assert "OK  exercise 06.2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, message",
    [
        (keras.losses.SparseCategoricalCrossentropy(from_logits=True), "every position"),
        (
            keras.losses.SparseCategoricalCrossentropy(reduction="mean_with_sample_weight"),
            "from_logits=True",
        ),
        (None, "not compiled"),
    ],
)
def test_a_masked_lm_loss_over_every_position_or_on_probabilities_is_refused(wrong, message):
    with pytest.raises(ExerciseCheckError, match=message):
        workshop_jax.check_masked_lm_loss(_Compiled(wrong))


def test_the_packed_compile_passes_and_each_wrong_choice_is_refused(capsys):
    """Exercise 07.3: the loss averaged over the packed examples (said of them, not of
    masked tokens), with notebook 01's optimizer, weighted metrics and steps per call."""

    def compiled(loss=None, metrics="weighted", rate=1e-3, per_call=4, optimizer=None):
        packed = keras.Sequential([keras.Input((6, 4)), keras.layers.Dense(3)])  # slots
        loss = loss or keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        )
        chosen = {"weighted_metrics" if metrics == "weighted" else "metrics": ["accuracy"]}
        packed.compile(
            optimizer=optimizer or keras.optimizers.Adam(rate),
            loss=loss,
            steps_per_execution=per_call,
            **chosen,
        )
        return packed

    workshop_jax.check_packed_loss(compiled(), 1e-3, 4)
    said = capsys.readouterr().out
    assert "OK  exercise 07.3: Adam at 0.001, the mean cross-entropy over the packed" in said
    wrong = [
        (
            compiled(loss=keras.losses.SparseCategoricalCrossentropy(True)),
            "every position.*empty slots weigh 0",
        ),
        (compiled(metrics="plain"), "weighted"),
        (compiled(rate=1e-2), "learning rate"),
        (compiled(per_call=1), "step"),
        (compiled(optimizer=keras.optimizers.SGD(1e-3)), "Adam"),
    ]
    for model, message in wrong:
        with pytest.raises(ExerciseCheckError, match=f"07.3.*{message}"):
            workshop_jax.check_packed_loss(model, 1e-3, 4)


def test_the_engines_packing_mask_and_positions_pass_the_packing_exercises(capsys):
    """``keras3.packed_attention`` and ``packed_positions`` (``keras.ops``, what the packed
    model computes) are the answers the checks of exercises 07.1 and 07.2 want."""
    from tpu_helpers import keras3
    from tpu_helpers.teaching import workshop

    workshop.check_attention_mask(keras3.packed_attention)
    workshop.check_restarted_positions(keras3.packed_positions)
    said = capsys.readouterr().out
    assert "OK  exercise 07.1" in said and "OK  exercise 07.2" in said


def test_a_keras_warmup_and_cosine_decay_passes_and_one_that_ends_late_is_refused(capsys):
    """Exercise 06.1 on Keras 3: CosineDecay warming up over its warmup_steps, then
    decaying over decay_steps; a decay far too long, or over one epoch of two, is refused."""
    from tpu_helpers.teaching import workshop

    schedules = keras.optimizers.schedules
    right = schedules.CosineDecay(0.0, 90, warmup_target=1e-4, warmup_steps=10)
    workshop.check_schedule(right, 1e-4, 100, 0.1, "06.1")
    assert "OK  exercise 06.1" in capsys.readouterr().out
    late = schedules.CosineDecay(0.0, 1000, warmup_target=1e-4, warmup_steps=10)
    with pytest.raises(ExerciseCheckError, match="still"):
        workshop.check_schedule(late, 1e-4, 100, 0.1, "06.1")
    early = schedules.CosineDecay(0.0, 45, warmup_target=1e-4, warmup_steps=10)  # one epoch of 2
    with pytest.raises(ExerciseCheckError, match="three quarters into the decay"):
        workshop.check_schedule(early, 1e-4, 100, 0.1, "06.1")
    no_warmup = schedules.CosineDecay(1e-4, 100)
    with pytest.raises(ExerciseCheckError, match="warmup from 0"):
        workshop.check_schedule(no_warmup, 1e-4, 100, 0.1, "06.1")


def _causal_packed(segments):
    width = segments.shape[1]
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] > 0)
    return same & np.tril(np.ones((width, width), bool))


@pytest.mark.parametrize(
    "wrong, message",
    [
        (
            lambda s: _causal_packed(s) | np.tril(np.ones(s.shape[1:] * 2, bool)),
            "must not see each other",
        ),
        (lambda s: s[:, :, None] == s[:, None, :], "never sees a later token"),
        (lambda s: _causal_packed(s) | (s[:, None, :] == 0), "padding key"),
        (lambda s: _causal_packed(s)[:, 0], "needs one row per query token"),
    ],
    ids=["across examples", "no causal rule", "padding seen", "one row"],
)
def test_the_causal_packed_mask_check_takes_the_mask_and_names_each_wrong_one(wrong, message):
    workshop_jax.check_causal_packed_mask(lambda s: keras.ops.convert_to_tensor(_causal_packed(s)))
    with pytest.raises(ExerciseCheckError, match=message):
        workshop_jax.check_causal_packed_mask(wrong)


def _labels(tokens, segments, answer):
    out = np.full(tokens.shape, workshop_jax.IGNORED)
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    out[:, :-1] = np.where(same & answer[:, 1:], tokens[:, 1:], workshop_jax.IGNORED)
    return out


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda t, s, a: np.where(a, t, workshop_jax.IGNORED), "the token after it"),
        (
            lambda t, s, a: np.pad(t[:, 1:], ((0, 0), (0, 1)), constant_values=-100),
            "not a response token",
        ),
        (lambda t, s, a: _labels(t, s, a)[:, :-1], "one per token"),
    ],
    ids=["not shifted", "prompts trained", "one short"],
)
def test_the_next_token_labels_check_takes_the_labels_and_names_each_wrong_one(wrong, message):
    workshop_jax.check_next_token_labels(_labels)
    with pytest.raises(ExerciseCheckError, match=message):
        workshop_jax.check_next_token_labels(wrong)
