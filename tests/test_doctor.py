import dataclasses
import sys

import pytest

import tpu_helpers.runtime.doctor  # noqa: F401  (the module; the package exports the function)
from tpu_helpers.runtime import RuntimeFacts

d = sys.modules["tpu_helpers.runtime.doctor"]

GOOD_VERSIONS = {
    "tensorflow": "2.21.0",
    "tf-keras": "2.21.0",
    "transformers": "4.57.6",
    "datasets": "5.0.1",
    "huggingface-hub": "0.36.2",
}


def facts(accelerator="cpu", versions=None, **changes):
    runtime = RuntimeFacts(
        platform="local",
        accelerator=accelerator,
        distributions=GOOD_VERSIONS if versions is None else versions,
    )
    base = d.DoctorFacts(
        runtime=runtime,
        keras_module="tf_keras.src.engine.training",
        legacy_flag="1",
        transformers_tf_error=None,
        transformers_sees_tf=True,
        device_types=("CPU",),
        datasets_sees_tf=True,
    )
    return dataclasses.replace(base, **changes)


TPU_VERSIONS = dict(
    {k: v for k, v in GOOD_VERSIONS.items() if k != "tensorflow"},
    **{"tensorflow-tpu": "2.20.0", "tf-keras": "2.20.1", "libtpu": "0.0.20"},
)


def by_name(checks):
    return {c.name: c for c in checks}


def test_good_environment_passes_every_check(capsys):
    checks = d.doctor(facts())
    assert len(checks) == len(d.CHECKS) + 1 and all(c.ok for c in checks)
    out = capsys.readouterr().out
    assert out.count("PASS") == len(d.CHECKS) + 1 and "FAIL" not in out


def test_tpu_vm_with_tpu_build_passes():
    checks = d.doctor(
        facts("tpu", TPU_VERSIONS, device_types=("CPU", "TPU", "TPU_SYSTEM")), verbose=False
    )
    assert all(c.ok for c in checks)
    assert "0.0.20" in by_name(checks)["libtpu"].detail


@pytest.mark.parametrize(
    "version, ok",
    [
        ("0.0.14", True),
        ("0.0.31", True),
        ("0.0.21.1", True),
        ("0.0.13", False),
        ("0.0.32", False),
        ("0.0.52", False),
    ],
)
def test_libtpu_range_edges(version, ok):
    checks = by_name(d.doctor(facts("tpu", dict(TPU_VERSIONS, libtpu=version)), verbose=False))
    assert checks["libtpu"].ok is ok


@pytest.mark.parametrize(
    "name, broken, fix_part",
    [
        ("tensorflow", facts(versions={"tf-keras": "2.21.0"}), "requirements.txt"),
        ("tensorflow", facts("tpu", versions={}), "tensorflow-tpu"),
        (
            "tf-keras",
            facts(versions=dict(GOOD_VERSIONS, **{"tf-keras": "2.20.0"})),
            "tf-keras~=2.21.0",
        ),
        (
            "tf-keras",
            facts(versions={k: v for k, v in GOOD_VERSIONS.items() if k != "tf-keras"}),
            "--no-deps",
        ),
        (
            "transformers",
            facts(versions=dict(GOOD_VERSIONS, transformers="5.0.0")),
            "transformers==4.57.6",
        ),
        ("transformers", facts(transformers_tf_error="ImportError: no TF"), "restart"),
        (
            "datasets",
            facts(versions=dict(GOOD_VERSIONS, datasets="5.2.0", **{"huggingface-hub": "1.31.0"})),
            "datasets>=4,<5.1",
        ),
        (
            "datasets",
            facts(versions=dict(GOOD_VERSIONS, **{"huggingface-hub": "1.0.1"})),
            "huggingface-hub<1.0",
        ),
        ("legacy keras", facts(legacy_flag=None), "TF_USE_LEGACY_KERAS"),
        ("legacy keras", facts(keras_module="keras.src.models.model"), "restart"),
        ("tpu devices", facts("tpu", device_types=("CPU",)), "tensorflow-tpu"),
        # Colab's v5e with tensorflow-tpu 2.20: reinstalling it cannot help; the main track
        (
            "tpu devices",
            facts("tpu", TPU_VERSIONS, device_types=("CPU",)),
            "open the main track, notebooks/NN_*.ipynb",
        ),
        ("libtpu", facts("tpu", dict(TPU_VERSIONS, libtpu="0.0.52")), "libtpu==0.0.20"),
        (
            "libtpu",
            facts("tpu", {k: v for k, v in TPU_VERSIONS.items() if k != "libtpu"}),
            "libtpu==0.0.20",
        ),
        ("datasets sees TF", facts("tpu", TPU_VERSIONS, datasets_sees_tf=False), "TF_AVAILABLE"),
        (
            "transformers sees TF",
            facts(
                versions=dict(GOOD_VERSIONS, **{"tensorflow-tpu": "2.20.0"}),
                transformers_sees_tf=False,
            ),
            "FORCE_TF_AVAILABLE",
        ),
    ],
)
def test_each_broken_environment_fails_its_check_with_a_fix(name, broken, fix_part):
    checks = by_name(d.doctor(broken, verbose=False))
    assert not checks[name].ok
    assert fix_part in checks[name].fix
    assert "fix:" in checks[name].line() and checks[name].line().startswith("FAIL")


def test_real_environment_passes():
    # The pinned CPU stack this suite runs on must satisfy its own doctor.
    checks = d.doctor(verbose=False)
    assert [c.name for c in checks if not c.ok] == []


@pytest.mark.parametrize("package", ["transformers", "datasets", "huggingface-hub"])
def test_a_version_string_that_cannot_be_read_is_a_failing_check_not_a_crash(package):
    versions = dict(GOOD_VERSIONS, **{package: "dev"})
    checks = {c.name: c for c in (check(facts(versions=versions)) for check in d.CHECKS)}
    name = "transformers" if package == "transformers" else "datasets"
    assert checks[name].status == d.FAIL
    assert "'dev' cannot be read" in checks[name].detail and "pip install" in checks[name].fix


KAGGLE_TPU = {
    "tensorflow-cpu": "2.20.0",
    "jax": "0.7.2",
    "libtpu": "0.0.21",
    "keras": "3.15.1",
    "keras-hub": "0.32.0",
    "transformers": "5.2.0",
    "datasets": "4.4.1",
    "huggingface-hub": "1.2.0",
}


def test_a_jax_tpu_runtime_gets_the_keras3_engine_checks_and_says_why(capsys):
    checks = by_name(d.doctor(facts("tpu", KAGGLE_TPU, jax_platforms=("tpu",))))
    assert "keras3 engine" in checks["engine"].detail and "JAX 0.7.2" in checks["engine"].detail
    assert checks["engine"].detail.startswith("local tpu, Python 3.")  # the runtime, named
    assert "jax 0.7.2 with libtpu 0.0.21" in checks["keras 3 engine"].detail
    assert set(checks) == {"engine", "keras 3 engine", "jax devices"}
    assert all(c.ok for c in checks.values()), capsys.readouterr().out
    assert "tf-keras" not in checks  # the TF engine's checks are not this runtime's


def test_the_keras3_checks_name_what_is_missing_and_the_fix():
    lacking = dict(KAGGLE_TPU, **{"keras-hub": None, "keras": "3.10.0"})
    checks = by_name(d.doctor(facts("tpu", lacking, jax_platforms=("cpu",)), verbose=False))
    engine = checks["keras 3 engine"]
    assert not engine.ok and "keras 3.10.0" in engine.detail and "keras-hub None" in engine.detail
    assert "--engine keras3" in engine.fix
    assert not checks["jax devices"].ok and "cpu" in checks["jax devices"].detail
