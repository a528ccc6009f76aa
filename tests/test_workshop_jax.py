"""The main track's exercise checks refuse the wrong answers a learner writes (JAX, 8
simulated devices: the Keras 3 legs)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from tpu_helpers import workshop_jax  # noqa: E402
from tpu_helpers.workshop import ExerciseCheckError  # noqa: E402


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
