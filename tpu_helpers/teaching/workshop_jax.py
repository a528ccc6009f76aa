"""The checks behind the main track's exercises (Keras 3 and JAX, ``notebooks/``).

Each ``check_*`` takes what the learner wrote, raises ``ExerciseCheckError`` naming what
is wrong and how to fix it, or prints what was right; the checks that need neither JAX
nor TensorFlow's step (widths, records, schedules, masks), which both tracks call, are in
``workshop``. JAX is imported when a check runs, so that importing this module starts
nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tpu_helpers.teaching.workshop import _fail, _learners, _ok, values_match

__all__ = [
    "check_sharded_batch",
    "check_global_mean",
    "filler_batch",
    "check_train_step",
    "check_train_steps",
    "check_same_values_jitted",
    "masked_loss_reference",
    "check_static_loss_jitted",
    "check_masked_lm_loss",
    "check_packed_loss",
    "busy_step",
    "check_timing",
    "IGNORED",
    "check_causal_packed_mask",
    "check_next_token_labels",
]


def _devices_of(array) -> list:
    return [shard.device for shard in array.addressable_shards]


# --- 00 ---------------------------------------------------------------------------------
def check_sharded_batch(placed, batch, devices, exercise: str = "00.1") -> None:
    """``placed``: ``batch`` (a global batch, rows on axis 0) put on ``devices``, each
    holding its own consecutive ``len(batch) / len(devices)`` rows, none twice."""
    import jax

    if not isinstance(placed, jax.Array):
        _fail(exercise, f"placed is a {type(placed).__name__}: jax.device_put(batch, sharding).")
    batch = np.asarray(batch)
    if placed.shape != batch.shape or not np.array_equal(np.asarray(placed), batch):
        _fail(exercise, f"placed holds {placed.shape}, not the batch {batch.shape}: put `batch`.")
    if sorted(map(str, _devices_of(placed))) != sorted(map(str, devices)):
        _fail(
            exercise,
            f"placed lies on {len(_devices_of(placed))} device(s), not the {len(devices)} of"
            " `devices`: build the mesh from all of them, Mesh(np.array(devices), ('batch',)).",
        )
    rows = len(batch) // len(devices)
    shapes = {shard.data.shape[0] for shard in placed.addressable_shards}
    if shapes != {rows}:
        _fail(
            exercise,
            f"each device holds {sorted(shapes)} row(s); split over {len(devices)} devices each"
            f" holds {rows}: a copy of the whole batch on every device is PartitionSpec() (or"
            " a sharding of another axis); the batch axis is PartitionSpec('batch').",
        )
    held = [range(len(batch))[shard.index[0]] for shard in placed.addressable_shards]
    every = sorted(i for rows_of_one in held for i in rows_of_one)
    if every != list(range(len(batch))):
        _fail(exercise, "some rows are on two devices and some on none.")
    _ok(exercise, f"{len(batch)} rows over {len(devices)} device(s), {rows} on each, none twice")


def filler_batch(devices, per_device: int = 4, seed: int = 0):
    """Per-example losses and weights of one global batch, sharded over ``devices``, whose
    weight-0 filler rows all sit on the last device (as a data set's last batch): the
    weighted mean over the batch then differs from the mean of each device's mean."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    rows = per_device * len(devices)
    values = np.random.default_rng(seed).uniform(0.5, 3.0, rows).astype("float32")
    weights = np.ones(rows, "float32")
    weights[rows - per_device + 1 :] = 0.0  # one real row on the last device
    values[weights == 0] = 100.0  # what a filler row's loss may be: anything
    sharding = NamedSharding(Mesh(np.array(devices), ("batch",)), PartitionSpec("batch"))
    return jax.device_put(values, sharding), jax.device_put(weights, sharding)


def check_global_mean(weighted_mean: Callable, devices, exercise: str = "00.2") -> None:
    """``weighted_mean(values, weights)``: sum(weights * values) / sum(weights) over the
    whole global batch, compiled by ``jax.jit``, on arrays sharded over ``devices``."""
    import jax

    values, weights = filler_batch(devices)
    expected = float(np.sum(np.asarray(values) * np.asarray(weights)) / np.sum(weights))
    try:
        jax.jit(weighted_mean).trace(values, weights)
    except jax.errors.ConcretizationTypeError as error:
        _fail(
            exercise,
            f"weighted_mean does not compile: {str(error).splitlines()[0]} Fix: jax.numpy"
            " operations only, no float(), int() or Python if on the arrays.",
        )
    except Exception:  # noqa: BLE001, S110  (said by the call below, with the learner's error)
        pass
    got = _learners(jax.jit(weighted_mean), exercise, values, weights)
    if np.shape(got) != ():
        _fail(exercise, f"weighted_mean returns shape {np.shape(got)}: one number for the batch.")
    got = float(got)
    if np.isclose(got, float(np.mean(np.asarray(values)))):
        _fail(exercise, "the filler rows count: multiply each value by its weight.")
    if np.isclose(got, expected * float(np.sum(weights)) / len(values)):
        _fail(
            exercise,
            "divided by the rows of the batch, filler rows included: divide by the sum of the"
            " weights.",
        )
    if not np.isclose(got, expected, rtol=1e-5):
        _fail(
            exercise,
            f"weighted_mean gives {got:.4f}, the batch's weighted mean is {expected:.4f}."
            " Write it for the whole batch as on one device (jnp.sum over all rows): JAX"
            " adds the devices' partial sums itself; a mean of each device's mean is not it.",
        )
    _ok(exercise, f"{expected:.4f} over {len(devices)} device(s), filler rows left out")


# --- 02 ---------------------------------------------------------------------------------
def _fits_step(model, state, batch):
    """The state after one step of ``fit`` (Keras' own ``train_step``) from ``state``."""
    import jax

    metrics = [np.zeros(v.shape, v.dtype) for v in model.metrics_variables]
    _, new = jax.jit(model.train_step)((*state, metrics), batch)
    return new[:3]


def _differs(got, expected) -> str | None:
    """What differs between two states (or their first parts), or None."""
    names = ("trainable weights", "non-trainable variables (dropout seeds)", "optimizer")
    for name, ours, theirs in zip(names, got, expected, strict=False):
        if len(ours) != len(theirs):
            return f"{len(ours)} {name} returned for {len(theirs)}"
        for a, b in zip(ours, theirs, strict=True):
            if np.shape(a) != np.shape(b) or not np.allclose(
                np.asarray(a, "float64"), np.asarray(b, "float64"), rtol=1e-4, atol=1e-6
            ):
                return f"the {name} differ"
    return None


def check_train_step(train_step: Callable, model, batch, exercise: str = "02.1") -> None:
    """``train_step(state, batch) -> (state, loss)`` is one step of ``fit`` on ``model``
    (compiled with its loss and optimizer): the same new weights, dropout seeds and
    optimizer state, a loss that is the compiled loss, weight-0 rows counting for nothing."""
    import jax

    from tpu_helpers.keras3.steps import variable_values

    state = variable_values(model)
    got = _learners(jax.jit(train_step), exercise, state, batch)
    if not (isinstance(got, tuple) and len(got) == 2 and len(got[0]) == 3):
        _fail(exercise, "train_step must return (state, loss), state as it came: 3 lists.")
    (new, loss), expected = got, _fits_step(model, state, batch)
    if np.shape(loss) != ():
        _fail(exercise, f"the loss has shape {np.shape(loss)}: the batch's one number.")
    features, labels, weights = batch
    filler = np.asarray(weights) == 0
    if filler.any():  # other labels on the filler rows change nothing
        relabeled = np.where(filler, (np.asarray(labels) + 1) % 2, labels)
        again = _learners(jax.jit(train_step), exercise, state, (features, relabeled, weights))
        if _differs(again[0], new):
            _fail(
                exercise,
                "the filler rows (weight 0) change the step: pass the batch's weights to"
                " the loss (sample_weight=weights).",
            )
    if _differs(expected[1:2], state[1:2]) and not _differs(new[1:2], state[1:2]):
        _fail(
            exercise,
            "the dropout seeds did not move: return the non-trainable variables that"
            " model.stateless_call gives back (and call it with training=True).",
        )
    problem = _differs(new, expected)
    if problem:
        _fail(
            exercise,
            f"{problem} from fit's step: the gradient of the compiled loss (model.loss(labels, logits,"
            " sample_weight=weights)) of stateless_call(..., training=True), applied with"
            " optimizer.stateless_apply(optimizer_variables, grads, trainable).",
        )
    _ok(exercise, f"one step equals fit's on {len(labels)} rows ({int(filler.sum())} filler)")


def check_train_steps(
    train_steps: Callable, train_step: Callable, state, stack, exercise: str = "02.2"
) -> None:
    """``train_steps(state, stack) -> (state, losses)``: the steps of ``train_step`` over
    each batch of ``stack`` (batches stacked on a new first axis) in order, in one call."""
    import jax

    count = len(jax.tree.leaves(stack)[0])
    got = _learners(train_steps, exercise, state, stack)
    if not (isinstance(got, tuple) and len(got) == 2):
        _fail(exercise, "train_steps must return (state, losses), as jax.lax.scan does.")
    new, losses = got
    if np.shape(losses) != (count,):
        _fail(
            exercise,
            f"losses has shape {np.shape(losses)} for {count} stacked batches: one loss a"
            " step (scan stacks what each step returns).",
        )
    expected, expected_losses = state, []
    step = jax.jit(train_step)
    for index in range(count):
        expected, loss = step(expected, jax.tree.map(lambda a, i=index: a[i], stack))
        expected_losses.append(float(loss))
    if not np.allclose(np.asarray(losses), expected_losses, rtol=1e-4, atol=1e-6):
        _fail(
            exercise,
            f"the losses {np.round(np.asarray(losses), 4).tolist()} are not those of the"
            f" {count} steps in order {np.round(expected_losses, 4).tolist()}: each step"
            " starts from the state the one before returned.",
        )
    problem = _differs(new, expected)
    if problem:
        _fail(exercise, f"after {count} steps {problem} from {count} calls of train_step.")
    _ok(exercise, f"{count} steps in one call, the same as {count} calls of train_step")


# --- 05 ---------------------------------------------------------------------------------
def _compiles(function: Callable, exercise: str, *args):
    """``jax.jit(function)(*args)``, or a failed check naming the rule the code breaks."""
    import jax

    try:
        return jax.jit(function)(*args)
    except jax.errors.ConcretizationTypeError as error:  # a Python if/int/float on a tracer
        _fail(
            exercise,
            f"jax.jit cannot trace it: {str(error).splitlines()[0]} A traced value has no"
            " value yet: compute both results and pick with jnp.where (or jax.lax.cond).",
        )
    except (jax.errors.NonConcreteBooleanIndexError, IndexError) as error:
        _fail(
            exercise,
            f"jax.jit cannot trace it: {str(error).splitlines()[0]} A shape that depends on"
            " values (boolean indexing): keep every position and weight it 0 or 1.",
        )
    except Exception as error:  # noqa: BLE001  (the learner's code: say where it broke)
        name = getattr(function, "__name__", "the function")
        _fail(exercise, f"{name}(...) raised {type(error).__name__}: {str(error).splitlines()[0]}")


def check_same_values_jitted(
    function: Callable, reference: Callable, inputs, exercise: str = "05.1"
) -> None:
    """``function`` compiles with ``jax.jit`` and gives ``reference``'s value (run on
    NumPy, where a Python ``if`` works) on each of ``inputs`` (both sides of the
    condition and its edge belong there)."""
    values_match(
        lambda *args: _compiles(function, exercise, *args),
        lambda *args: reference(*[np.asarray(a) for a in args]),  # on NumPy: a Python if works
        inputs,
        exercise,
        "the condition and both results must stay",
    )
    _ok(exercise, f"jax.jit compiles it, and it has the original's values on {len(inputs)} inputs")


def masked_loss_reference(labels, logits) -> float:
    """The mean cross-entropy over the positions whose label is not -100 (NumPy)."""
    labels = np.asarray(labels)
    keep = labels != -100
    if not keep.any():
        return 0.0
    return float(_cross_entropy(np.where(keep, labels, 0), logits)[keep].mean())


def _cross_entropy(labels, logits) -> np.ndarray:
    """The cross-entropy of each position's class id on its logits (NumPy, float64)."""
    logits = np.asarray(logits, "float64")
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, np.asarray(labels)[..., None], -1)[..., 0]


def check_static_loss_jitted(loss_fn: Callable, exercise: str = "05.2") -> None:
    """``loss_fn(labels, logits)``: the mean cross-entropy over the labels that are not
    -100, compiled by ``jax.jit`` (no value-dependent shapes), 0 when every label is -100."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 6, 5)).astype("float32")
    cases = {
        "some labels -100": np.where(rng.random((4, 6)) < 0.4, -100, rng.integers(0, 5, (4, 6))),
        "no label -100": rng.integers(0, 5, (4, 6)),
    }
    for name, labels in cases.items():
        labels = labels.astype("int32")
        got = float(_compiles(loss_fn, exercise, labels, logits))
        want = masked_loss_reference(labels, logits)
        if not np.isclose(got, want, rtol=1e-4, atol=1e-5):
            _fail(
                exercise,
                f"with {name} the loss is {got:.5f}, the mean over the kept positions"
                f" {want:.5f}: weight each position's loss by (labels != -100) and divide by"
                " the number of kept positions.",
            )
    empty = float(_compiles(loss_fn, exercise, np.full((4, 6), -100, "int32"), logits))
    if not np.isfinite(empty) or empty != 0.0:
        _fail(
            exercise,
            f"a batch with every label -100 gives {empty}: divide by jnp.maximum(kept, 1).",
        )
    _ok(exercise, "jax.jit compiles it, the same loss, an all -100 batch gives 0")


# --- 06 ---------------------------------------------------------------------------------
def check_masked_lm_loss(model, exercise: str = "06.2") -> None:
    """``model`` compiled with the masked-LM loss: the cross-entropy of the token ids on
    the logits, averaged over the masked tokens only (the batches weigh them 1, every other
    position 0), as transformers computes it; not over every position."""
    got = _check_weighted_mean_loss(
        model,
        exercise,
        ("masked tokens", "token ids"),
        "85 % of the positions weigh 0, so it is far too small and changes with the share masked",
    )
    _ok(exercise, f"the mean cross-entropy over the masked tokens ({got:.4f} on a test batch)")


def check_packed_loss(
    model, learning_rate: float, steps_per_execution: int | None = None, exercise: str = "07.3"
) -> None:
    """``model`` (a packed classifier) compiled as notebook 01 compiles (Adam at
    ``learning_rate``, metrics the weights apply to: an empty slot's logits are its row's
    first example's, and must count for nothing; ``steps_per_execution`` steps a call), with
    the cross-entropy of each slot's class id on its logits averaged over the packed
    examples (slots of weight 1), as an unpacked batch averages over its examples."""
    from tpu_helpers.teaching.workshop import (
        _learning_rate_of,
        _optimizer_problem,
        _steps_per_call_problem,
        _weighted_metrics_problem,
    )

    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        _fail(exercise, "the model is not compiled: packed_model.compile(optimizer=..., ...).")
    per_call = int(getattr(model, "steps_per_execution", 1) or 1)
    problem = (
        _optimizer_problem(optimizer, learning_rate)
        or _weighted_metrics_problem(model)
        or _steps_per_call_problem(per_call, steps_per_execution)
    )
    if problem:
        _fail(exercise, problem)
    got = _check_weighted_mean_loss(
        model,
        exercise,
        ("packed examples", "class ids"),
        "the empty slots weigh 0 and their number changes from row to row, so it is too small"
        " and changes with the packing",
    )
    _ok(
        exercise,
        f"Adam at {_learning_rate_of(optimizer):g}, the mean cross-entropy over the packed"
        f" examples ({got:.4f} on a test batch), weighted metrics, {per_call} steps a call",
    )


def _check_weighted_mean_loss(model, exercise: str, what: tuple, why_not_all: str) -> float:
    """The compiled loss on a test batch of ``[2, 6]`` labels and weights, refused unless
    it is the cross-entropy on the logits averaged over the items of weight 1 (``reduction=
    "mean_with_sample_weight"``); returns it. ``what``: the items and their labels, in
    words; ``why_not_all``: why an average over every position is wrong there."""
    items, labels_are = what
    loss = getattr(model, "loss", None)
    if loss is None or getattr(model, "optimizer", None) is None:
        _fail(exercise, "the model is not compiled: model.compile(optimizer=..., loss=...).")
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 7, (2, 6)).astype("int32")
    logits = rng.normal(size=(2, 6, 7)).astype("float32")
    weights = np.zeros((2, 6), "float32")
    weights[0, 1] = weights[0, 4] = weights[1, 2] = 1.0
    each = _cross_entropy(labels, logits)
    want = float((each * weights).sum() / weights.sum())
    try:
        got = float(loss(labels, logits, sample_weight=weights))
    except Exception as error:  # noqa: BLE001  (the learner's loss: say where it broke)
        _fail(exercise, f"the compiled loss raised {error!r} on {labels_are} and logits.")
    if np.isclose(got, (each * weights).sum() / weights.size, rtol=1e-4):
        _fail(
            exercise,
            f"the loss is {got:.4f}: averaged over every position, weighted or not ({want:.4f}"
            f" over the {items}). {why_not_all[0].upper()}{why_not_all[1:]}. Fix:"
            " SparseCategoricalCrossentropy(..., reduction='mean_with_sample_weight').",
        )
    if not np.isclose(got, want, rtol=1e-4):
        _fail(
            exercise,
            f"the loss is {got:.4f}, and the cross-entropy of the {items}' {labels_are} on the"
            f" logits is {want:.4f}: the model returns logits (from_logits=True), and the"
            f" labels are {labels_are} (a sparse cross-entropy).",
        )
    return got


# --- 09 ---------------------------------------------------------------------------------
def busy_step(size: int | None = None, rounds: int | None = None):
    """A jitted function and its argument that take a measurable while on any device (tens
    of milliseconds a call on a CPU or a TPU): ``rounds`` matrix products of ``size`` x
    ``size`` in one compiled call (each call of ``busy_step`` makes a new function: its
    first call compiles)."""
    import jax

    cpu = jax.devices()[0].platform == "cpu"
    size = size or (384 if cpu else 4096)
    rounds = rounds or (150 if cpu else 100)

    def work(x):
        return jax.lax.fori_loop(0, rounds, lambda _, y: jax.numpy.tanh(y @ x), x)

    x = jax.numpy.asarray(np.random.default_rng(0).normal(size=(size, size)) / size, "float32")
    return jax.jit(work), x


def _timed_right(step, args, calls: int) -> float:
    import time

    import jax

    jax.block_until_ready(step(*args))
    start = time.perf_counter()
    for _ in range(calls):
        out = step(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def check_timing(seconds_per_call: Callable, exercise: str = "09.2", calls: int = 8) -> None:
    """``seconds_per_call(step, args, calls)``: the seconds one call of the jitted ``step``
    on ``args`` takes on the device, averaged over ``calls`` calls, the first (compiling)
    call not counted. A jitted call returns before the device has run it (JAX dispatches
    asynchronously): a time without ``jax.block_until_ready`` is the dispatch's. The
    check's own timing runs before and after the learner's, so that a machine busy during
    one of them does not decide the verdict (a time of all the calls is ``calls`` times
    too long, far beyond that noise)."""
    step, x = busy_step()
    before = _timed_right(step, (x,), calls)
    try:
        got = float(seconds_per_call(step, (x,), calls))
    except Exception as error:  # noqa: BLE001  (the learner's code: say where it broke)
        _fail(exercise, f"seconds_per_call(step, args, calls) raised {error!r}.")
    after = _timed_right(step, (x,), calls)
    want = min(before, after)
    if got < 0.3 * want:
        _fail(
            exercise,
            f"{got * 1e3:.2f} ms per call, and the device takes {want * 1e3:.1f} ms: that is"
            " the time to dispatch the calls, which return before the device has run them."
            " Wait for the result before stopping the clock: jax.block_until_ready(out).",
        )
    want = max(before, after)
    if got > 2.5 * want:
        shown = f"{got * 1e3:.1f} ms per call, and one call takes {want * 1e3:.1f} ms"
        _fail(
            exercise,
            f"{shown}: divide the time of the timed calls by `calls`, and call the step once"
            " before starting the clock (the first call compiles).",
        )
    _ok(exercise, f"{got * 1e3:.1f} ms per call (the device's own: {want * 1e3:.1f} ms)")


#: The label of a token the loss leaves out (``SparseCategoricalCrossentropy(ignore_class=)``).
IGNORED = -100


def check_causal_packed_mask(allowed: Callable, exercise: str = "10.1") -> None:
    """``allowed(segment_ids)`` gives ``[rows, T, T]`` booleans: query ``i`` may see key
    ``j`` when both are tokens of the same example and ``j <= i`` (no later token, no
    other example, no padding)."""
    from tpu_helpers.teaching.workshop import check_mask, packed_segments

    segments = packed_segments()
    width = segments.shape[1]
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] > 0)

    def why(i, j, kj, wanted):
        if wanted:
            return "a token must see itself and the earlier tokens of its own example"
        if kj == 0:
            return "a padding key (segment 0) must be hidden"
        if j > i:
            return "a decoder never sees a later token (key j > query i): and-combine with j <= i"
        return "tokens of different examples must not see each other"

    check_mask(allowed, same & np.tril(np.ones((width, width), bool))[None], why, exercise)
    _ok(exercise, "each token sees itself and the earlier tokens of its own example only")


def check_next_token_labels(next_token_labels: Callable, exercise: str = "10.2") -> None:
    """``next_token_labels(token_ids, segment_ids, response)`` gives ``[rows, T]`` labels:
    at ``i`` the token ``i + 1`` where that token is a response token of the same example,
    ``IGNORED`` elsewhere (prompts, the last token of an example, padding, the row's end)."""
    segments = np.array([[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8) + 10
    response = np.array([[0, 0, 1, 1, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1, 1]], bool)
    want = np.full(tokens.shape, IGNORED, np.int32)
    follows = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0) & response[:, 1:]
    want[:, :-1] = np.where(follows, tokens[:, 1:], IGNORED)
    got = np.asarray(_learners(next_token_labels, exercise, tokens, segments, response))
    if got.shape != want.shape:
        _fail(exercise, f"labels of shape {list(got.shape)}; one per token: {list(want.shape)}.")
    wrong = np.argwhere(got != want)
    if len(wrong):
        r, i = (int(v) for v in wrong[0])
        if want[r, i] == IGNORED and i + 1 < tokens.shape[1] and got[r, i] == tokens[r, i + 1]:
            why = (
                "the next token there is not a response token of the same example"
                f" (segment {segments[r, i]} -> {segments[r, i + 1]}, response {bool(response[r, i + 1])}):"
                f" label it {IGNORED}"
            )
        elif want[r, i] == IGNORED:
            why = f"nothing is predicted there: label it {IGNORED}"
        else:
            why = f"the label at a token is the token after it ({want[r, i]}), a response token of its example"
        _fail(
            exercise,
            f"row {r}, token {i}: label {got[r, i]}, but {why}. {len(wrong)} labels differ.",
        )
    _ok(
        exercise, "each response token is the label of the token before it; nothing else is trained"
    )
