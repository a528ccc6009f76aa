"""The checks behind the main track's exercises (Keras 3 and JAX, ``notebooks/``).

Each ``check_*`` takes what the learner wrote, raises ``ExerciseCheckError`` naming what
is wrong and how to fix it, or prints what was right; the seeds' track's checks are in
``workshop``. JAX is imported when a check runs, so that importing this module starts
nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tpu_helpers.workshop import _fail, _learners, _ok

__all__ = ["check_sharded_batch", "check_global_mean", "filler_batch"]


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
