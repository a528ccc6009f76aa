import logging
import sys

import pytest

from tpu_helpers import runtime
from tpu_helpers.core import families
from tpu_helpers.runtime import (
    RuntimeFacts,
    detect_runtime,
    install,
    install_commands,
    pip_argv,
)
from tpu_helpers.runtime import env as runtime_env

GOOD = {
    "tensorflow": "2.21.0",
    "tf-keras": "2.21.0",
    "transformers": "4.57.6",
    "datasets": "5.0.1",
    "huggingface-hub": "0.36.2",
    "tensorboard": "2.21.0",
    "tensorboard-plugin-profile": "2.24.2",
}


def facts(platform="colab", accelerator="tpu", **versions):
    return RuntimeFacts(platform=platform, accelerator=accelerator, distributions=versions)


def no_paths(_path):
    return False


@pytest.mark.parametrize(
    "env, paths, modules, versions, expected",
    [
        ({}, set(), {}, {}, ("local", "cpu")),
        ({"COLAB_RELEASE_TAG": "release-x"}, {"/dev/accel0"}, {}, {}, ("colab", "tpu")),
        ({}, set(), {"google.colab": object()}, {}, ("colab", "cpu")),
        ({"COLAB_RELEASE_TAG": "r", "COLAB_GPU": "1"}, set(), {}, {}, ("colab", "gpu")),
        (
            {"KAGGLE_KERNEL_RUN_TYPE": "Batch", "TPU_ACCELERATOR_TYPE": "v3-8"},
            set(),
            {},
            {},
            ("kaggle", "tpu"),
        ),
        (
            {"KAGGLE_URL_BASE": "https://www.kaggle.com"},
            {"/dev/nvidia0"},
            {},
            {},
            ("kaggle", "gpu"),
        ),
        ({}, {"/dev/accel0"}, {}, {}, ("tpu-vm", "tpu")),
        ({}, {"/dev/vfio/0"}, {}, {"libtpu": "0.0.14"}, ("tpu-vm", "tpu")),
        ({}, {"/dev/vfio/0"}, {}, {}, ("local", "cpu")),  # vfio alone is not a TPU
        ({"TPU_NAME": "my-pod"}, set(), {}, {}, ("tpu-vm", "tpu")),
        ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, set(), {"google.colab": 1}, {}, ("colab", "tpu")),
    ],
)
def test_detect_runtime(env, paths, modules, versions, expected):
    found = detect_runtime(
        environ=env, path_exists=paths.__contains__, modules=modules, versions=versions
    )
    assert (found.platform, found.accelerator) == expected


def test_detect_runtime_keeps_versions_and_tpu_type():
    found = detect_runtime(
        environ={"TPU_ACCELERATOR_TYPE": "v5litepod-1"},
        path_exists=no_paths,
        modules={},
        versions={"tensorflow-tpu": "2.20.0"},
    )
    assert found.tpu_type == "v5litepod-1"
    assert found.tensorflow_build == "tensorflow-tpu"
    assert found.tensorflow_version == "2.20.0"
    assert found.distributions["transformers"] is None


def test_plain_machine_installs_nothing():
    assert install_commands(facts("local", "cpu")) == []
    assert install_commands(facts("local", "cpu", **GOOD)) == []


def test_colab_tpu_without_tensorflow():
    plan = install_commands(
        facts(
            "colab", "tpu", transformers="5.1.0", datasets="4.4.1", **{"huggingface-hub": "1.2.0"}
        )
    )
    assert plan[0] == "pip install -q tensorflow-tpu==2.20.0 libtpu==0.0.20"
    assert "pip install -q --no-deps 'tf-keras~=2.20.0'" in plan
    assert "pip install -q transformers==4.57.6 'datasets>=4,<5.1' 'huggingface-hub<1.0'" in plan
    # TensorBoard of the TensorFlow just installed, with the profile plugin
    assert plan[-1] == "pip install -q 'tensorboard~=2.20.0' tensorboard-plugin-profile==2.24.2"
    assert not any(c.startswith("pip uninstall") for c in plan)


def test_kaggle_tpu_with_tensorflow_cpu_swaps_the_build_for_the_one_known_to_load():
    # tensorflow-tpu 2.18 / 2.19 ask for a libtpu the package index does not have, so an
    # image's older minor is not kept: every TPU runtime gets tensorflow-tpu 2.20.0.
    plan = install_commands(
        facts(
            "kaggle",
            "tpu",
            **{"tensorflow-cpu": "2.18.0", "tf-keras": "2.18.0"},
            transformers="4.57.6",
            datasets="4.0.0",
            **{"huggingface-hub": "0.36.0", "tensorboard": "2.18.0"},
        )
    )
    assert plan == [
        "pip uninstall -y tensorflow-cpu",
        "pip install -q tensorflow-tpu==2.20.0 libtpu==0.0.20",
        "pip install -q --no-deps 'tf-keras~=2.20.0'",
        "pip install -q tensorboard-plugin-profile==2.24.2",  # TensorBoard itself is there
    ]


@pytest.mark.parametrize("libtpu", ["0.0.52", "0.0.32", None])
def test_tpu_build_next_to_a_libtpu_that_aborts_gets_the_pinned_libtpu(libtpu):
    versions = dict(GOOD, **{"tensorflow-tpu": "2.20.0", "tf-keras": "2.20.1", "libtpu": libtpu})
    del versions["tensorflow"]
    assert install_commands(facts("colab", "tpu", **versions)) == ["pip install -q libtpu==0.0.20"]


def test_tpu_with_tensorflow_newer_than_any_tpu_build():
    plan = install_commands(facts("tpu-vm", "tpu", **GOOD))
    assert plan[0] == "pip uninstall -y tensorflow"
    assert "tensorflow-tpu==2.20.0" in plan[1]
    assert "pip install -q --no-deps 'tf-keras~=2.20.0'" in plan  # 2.21 tf-keras no longer fits


def test_tpu_runtime_already_good():
    versions = dict(GOOD, **{"tensorflow-tpu": "2.20.0", "tf-keras": "2.20.1", "libtpu": "0.0.21"})
    del versions["tensorflow"]
    assert install_commands(facts("colab", "tpu", **versions)) == []


def test_gpu_runtime_needs_only_a_matching_tf_keras():
    versions = dict(GOOD, tensorflow="2.19.0", **{"tf-keras": "2.21.0"})
    assert install_commands(facts("colab", "gpu", **versions)) == [
        "pip install -q --no-deps 'tf-keras~=2.19.0'"
    ]


def test_gpu_runtime_without_tensorflow_gets_the_cuda_build():
    plan = install_commands(facts("kaggle", "gpu"))
    assert plan[0] == "pip install -q 'tensorflow[and-cuda]==2.21.0'"
    assert "pip install -q --no-deps 'tf-keras~=2.21.0'" in plan


def test_install_runs_only_on_hosted_runtimes(capsys):
    calls = []
    plan = install(facts("tpu-vm", "tpu"), run=lambda *a, **k: calls.append(a))
    assert plan and calls == []
    assert "nothing is run" in capsys.readouterr().out
    plan = install(facts("colab", "tpu"), run=lambda argv, **k: calls.append(argv))
    assert len(calls) == len(plan)
    # each command runs with this interpreter's own pip, never a bare `pip` from PATH
    assert all(argv[:3] == [sys.executable, "-m", "pip"] for argv in calls)
    assert calls[0][3:] == ["install", "-q", "tensorflow-tpu==2.20.0", "libtpu==0.0.20"]


def test_install_sets_the_flags_again_after_the_plan(monkeypatch, capsys):
    # The install cell imports tpu_helpers before the plan installs tensorflow-tpu, so the
    # flags that depend on it must be set once more after installing.
    seen = []
    monkeypatch.setattr(runtime_env, "prepare_environment", lambda: seen.append("again") or [])
    install(facts("colab", "tpu"), run=lambda *a, **k: None)
    assert seen == ["again"]


def test_install_asks_for_a_restart_only_for_packages_already_imported(monkeypatch, capsys):
    monkeypatch.setattr(runtime_env, "prepare_environment", lambda: [])
    for name in runtime._MODULES.values():
        monkeypatch.delitem(sys.modules, name, raising=False)
    install(facts("colab", "tpu"), run=lambda *a, **k: None)
    assert "Restart" not in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "transformers", object())
    install(facts("colab", "tpu"), run=lambda *a, **k: None)
    out = capsys.readouterr().out
    assert "transformers changed after it was imported" in out and "Restart session" in out
    assert "tensorflow," not in out  # not imported, so not named


def test_pip_argv_refuses_other_commands():
    with pytest.raises(ValueError, match="not a pip command"):
        pip_argv("rm -rf /")


def test_install_on_a_good_machine_says_so(capsys):
    assert install(facts("local", "cpu", **GOOD), run=None) == []
    assert "nothing to install" in capsys.readouterr().out


def _record(message, level=logging.WARNING):
    return logging.LogRecord("tensorflow", level, "x.py", 1, message, None, None)


def test_known_noise_is_filtered_and_real_warnings_are_not():
    noise = runtime_env.KnownNoise()
    pooler = (
        "Gradients do not exist for variables ['tf_mpnet_for_sequence_classification/mpnet/"
        "pooler/dense/kernel:0', 'tf_mpnet_for_sequence_classification/mpnet/pooler/dense/"
        "bias:0'] when minimizing the loss."
    )
    assert not noise.filter(_record(pooler))
    real = "Gradients do not exist for variables ['model/classifier/kernel:0'] when minimizing"
    assert noise.filter(_record(real))
    mixed = pooler.replace(
        "'tf_mpnet_for_sequence_classification/mpnet/pooler/dense/bias:0'",
        "'model/classifier/bias:0'",
    )
    assert noise.filter(_record(mixed))
    collective = "Collective all_reduce tensors: 1 all_reduces, num_devices = 2"
    assert not noise.filter(_record(collective, logging.INFO))
    assert noise.filter(_record("Collective ops failed", logging.ERROR))


def test_the_noise_filter_is_installed_once():
    runtime_env.quiet_known_noise()
    runtime_env.quiet_known_noise()
    filters = logging.getLogger("tensorflow").filters
    assert sum(isinstance(f, runtime_env.KnownNoise) for f in filters) == 1


def test_a_module_is_changed_right_after_its_first_import_and_only_then(tmp_path, monkeypatch):
    """What sets datasets.config.TF_AVAILABLE for tensorflow-tpu when datasets is imported
    after tpu_helpers (it is not imported up front: seconds a worker need not spend)."""
    package = tmp_path / "late_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from late_pkg import config\n")
    (package / "config.py").write_text("FLAG = False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def then(module):
        seen.append(module.FLAG)  # the module has run: its own value is there
        module.FLAG = True

    finder = runtime_env._AfterImport("late_pkg.config", then)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    import late_pkg

    assert late_pkg.config.FLAG is True and seen == [False]
    assert finder not in sys.meta_path  # once: a reload is not patched again
    assert "late_pkg.config" in sys.modules and sys.modules["late_pkg.config"].FLAG
    for name in ("late_pkg", "late_pkg.config"):
        monkeypatch.delitem(sys.modules, name)


def test_the_tpu_build_flag_for_datasets_waits_for_datasets(monkeypatch):
    monkeypatch.setattr(runtime_env, "only_tpu_build", lambda: True)
    monkeypatch.setattr(runtime_env, "distribution_version", lambda name: "2.20.0")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, "datasets.config", raising=False)
    assert runtime_env.tell_datasets_tensorflow_is_there()
    assert runtime_env.tell_datasets_tensorflow_is_there()  # again: still one hook
    hooks = [f for f in sys.meta_path if isinstance(f, runtime_env._AfterImport)]
    assert [h.name for h in hooks] == ["datasets.config"]
    config = type("Config", (), {"TF_AVAILABLE": False, "TF_VERSION": "N/A"})
    hooks[0].then(config)  # what runs once datasets.config has been executed
    assert config.TF_AVAILABLE is True and str(config.TF_VERSION) == "2.20.0"


@pytest.mark.parametrize("tf_keras, flag", [("2.21.0", "1"), (None, None)])
def test_the_legacy_keras_flag_is_set_only_where_tf_keras_is_installed(monkeypatch, tf_keras, flag):
    """tf-keras present (the TF engine's stacks): ``TF_USE_LEGACY_KERAS=1``; absent (a Keras 3
    runtime): no flag, which TensorFlow would answer with a warning to install tf_keras."""
    monkeypatch.setattr(runtime_env, "only_tpu_build", lambda: False)
    monkeypatch.setattr(runtime_env, "distribution_version", {"tf-keras": tf_keras}.get)
    env = {}
    changed = runtime_env.prepare_environment(env)
    assert env.get("TF_USE_LEGACY_KERAS") == flag
    assert ("TF_USE_LEGACY_KERAS" in changed) == (flag is not None)


# What Kaggle's TPU image ships (Kaggle/docker-python tpu/requirements.in), and Colab's.
KAGGLE_TPU = {
    "tensorflow-cpu": "2.20.0",
    "jax": "0.7.2",
    "jaxlib": "0.7.2",
    "libtpu": "0.0.21",
    "keras": "3.15.1",
    "transformers": "5.2.0",
    "datasets": "4.4.1",
    "huggingface-hub": "1.2.0",
    **dict.fromkeys(
        ["absl-py", "regex", "rich", "kagglehub", "safetensors", "tokenizers", "sentencepiece"],
        "1.0",
    ),
}
COLAB_TPU = {"jax": "0.7.2", "libtpu": "0.0.21", "keras": "3.10.0", "transformers": "5.2.0"}


def test_a_tpu_runtime_that_ships_jax_favours_the_keras3_engine_and_keeps_its_jax():
    choice = runtime.choose_engine(facts("kaggle", "tpu", **KAGGLE_TPU))
    assert choice.engine == "keras3"
    assert "JAX 0.7.2" in choice.reason and "libtpu 0.0.21" in choice.reason
    plan = runtime.keras3_install_commands(facts("kaggle", "tpu", **KAGGLE_TPU))
    assert plan == ["pip install -q --no-deps keras-hub==0.32.0"]  # no tensorflow-text


def test_the_keras3_plan_on_colab_adds_what_the_image_lacks_and_never_jax_or_libtpu():
    plan = runtime.keras3_install_commands(facts("colab", "tpu", **COLAB_TPU))
    assert runtime.choose_engine(facts("colab", "tpu", **COLAB_TPU)).engine == "keras3"
    joined = " ".join(plan)
    assert "'keras>=3.15,<4'" in joined  # 3.10 is older than KerasHub 0.32 needs
    assert "tensorflow-cpu==2.20.0" in joined  # tf.data and TensorBoard's summaries
    assert plan[-1] == "pip install -q --no-deps keras-hub==0.32.0"
    for kept in ("jax", "libtpu", "tensorflow-tpu", "transformers=="):
        assert kept not in joined


def test_a_family_the_keras3_engine_does_not_train_gets_a_fix_that_works_on_the_runtime():
    """Where the TF engine runs, such a family goes to it; on a TPU runtime that ships JAX and
    no tensorflow-tpu (Kaggle's, Colab's), the TF engine would replace the runtime's libtpu:
    the Keras 3 engine stays, and the reason is the fix that works there."""
    choice = runtime.choose_engine(facts("kaggle", "tpu", **KAGGLE_TPU), model_type="mpnet")
    assert choice.engine == "keras3" and "'mpnet'" in choice.reason
    assert "Fix: a checkpoint of one of those families" in choice.reason
    assert "not Colab's or Kaggle's TPU runtime" in choice.reason
    choice = runtime.choose_engine(facts("local", "cpu", **GOOD), model_type="mpnet")
    assert choice.engine == "tf" and "'mpnet'" in choice.reason and "TF engine" in choice.reason
    for family in families.KERAS3:
        assert (
            runtime.choose_engine(facts("kaggle", "tpu", **KAGGLE_TPU), family).engine == "keras3"
        )


def test_the_pinned_stack_and_a_tpu_with_tensorflow_tpu_favour_the_tf_engine():
    assert runtime.choose_engine(facts("local", "cpu", **GOOD)).engine == "tf"
    tpu = dict(GOOD, **{"tensorflow-tpu": "2.20.0", "libtpu": "0.0.20", "jax": "0.7.2"})
    assert runtime.choose_engine(facts("colab", "tpu", **tpu)).engine == "tf"
    keras3_here = dict(KAGGLE_TPU)  # a machine like the Keras 3 leg's: no TPU
    assert runtime.choose_engine(facts("local", "cpu", **keras3_here)).engine == "keras3"
    # Colab's CPU runtime ships tf-keras too; with transformers 5 the TF engine cannot run
    with_tf_keras = dict(keras3_here, **{"tf-keras": "2.19.0"})
    assert runtime.choose_engine(facts("colab", "cpu", **with_tf_keras)).engine == "keras3"
    with_transformers_4 = dict(with_tf_keras, transformers="4.57.6")
    assert runtime.choose_engine(facts("colab", "cpu", **with_transformers_4)).engine == "tf"


def test_install_says_which_engine_the_runtime_favours_and_refuses_an_unknown_one(capsys):
    ran = []
    plan = install(
        facts("kaggle", "tpu", **KAGGLE_TPU),
        run=lambda argv, check: ran.append(argv),
        engine="keras3",
    )
    said = capsys.readouterr().out
    assert "favours the keras3 engine" in said
    assert plan == ["pip install -q --no-deps keras-hub==0.32.0"] and len(ran) == 1
    with pytest.raises(ValueError, match="engine='tf' or 'keras3'"):
        install(facts("kaggle", "tpu", **KAGGLE_TPU), engine="jax")


def test_the_keras3_install_says_each_change_and_why_before_running_any(capsys):
    said = []
    install(
        facts("colab", "tpu", **COLAB_TPU),
        run=lambda argv, check: said.append(capsys.readouterr().out),
        engine="keras3",
    )
    before_first = said[0]  # all that was printed before the first command ran
    assert "keras (installed: 3.10.0): KerasHub 0.32 asks Keras >= 3.15" in before_first
    assert "tensorflow-cpu (installed: none): tf.data" in before_first
    assert "keras-hub==0.32.0" in before_first


def _install_changing(monkeypatch, after: dict, plan_facts):
    readings = iter([{"jax": "0.7.2", "numpy": "2.1.3", "keras": "3.10.0", "pillow": "12"}, after])
    monkeypatch.setattr(runtime, "installed", lambda: next(readings))
    return install(plan_facts, run=lambda argv, check: None, engine="keras3")


def test_a_keras3_install_that_touches_the_runtimes_own_packages_is_refused(monkeypatch, capsys):
    colab = facts("colab", "tpu", **COLAB_TPU)
    good = {
        "jax": "0.7.2",
        "numpy": "2.1.3",
        "keras": "3.15.1",
        "pillow": "12",
        "keras-hub": "0.32",
    }
    _install_changing(monkeypatch, good, colab)  # keras named by the plan; keras-hub added
    assert "[install] keras: 3.10.0 -> 3.15.1" in capsys.readouterr().out
    with pytest.raises(runtime.InstallError, match=r"numpy 2\.1\.3 -> 2\.4\.6 \(the runtime keeps"):
        _install_changing(monkeypatch, dict(good, numpy="2.4.6"), colab)
    # a requirement pip moved for a named package: said, not refused (the test leg refuses it)
    _install_changing(monkeypatch, {k: v for k, v in good.items() if k != "pillow"}, colab)
    assert "also changed: pillow 12 -> None (not in the plan)" in capsys.readouterr().out
    assert runtime.unplanned_changes({"pillow": ("12", None)}, []) == [
        "pillow 12 -> None (not in the plan)"
    ]
    assert runtime.install_changes({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "1"}) == {
        "b": ("2", "3"),
        "c": (None, "1"),
    }


def test_the_families_the_engine_choice_names_are_the_ones_the_keras3_engine_has_heads_for():
    # runtime stays importable without Keras (the install cell runs it first), so the list
    # is written twice; this holds the two together
    from tpu_helpers.keras3.models import HEADS

    assert set(families.KERAS3) == set(HEADS)


def _image(name: str) -> tuple[str, dict]:
    """The Python version and ``{distribution: version}`` an image file of tools/ pins."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "tools" / name).read_text()
    python = next(line.split(":")[1].strip() for line in text.splitlines() if "# python:" in line)
    pins = {}
    for line in text.splitlines():
        if "==" in line and not line.startswith("#"):
            name_, version = line.split("==")
            pins[name_.split("[")[0].strip().lower()] = version.strip()
    return python, pins


def test_the_colab_leg_starts_from_colabs_tpu_runtime_as_recorded():
    """tools/colab-tpu-image.txt is Colab's TPU runtime as googlecolab/backend-info recorded
    it (2026-08-19): moving the leg to a newer stack is a change of that file, seen here."""
    python, pins = _image("colab-tpu-image.txt")
    assert python == "3.13"
    assert (pins["jax"], pins["jaxlib"], pins["keras"]) == ("0.7.2", "0.7.2", "3.13.2")
    assert (pins["transformers"], pins["numpy"], pins["h5py"]) == ("5.15.0", "2.1.3", "3.16.0")
    assert not {"tensorflow", "tensorflow-cpu", "tensorflow-tpu", "keras-hub", "torch"} & set(pins)


def test_the_keras3_plan_on_colabs_image_keeps_what_the_runtime_keeps():
    _, pins = _image("colab-tpu-image.txt")
    plan = runtime.keras3_install_commands(facts("colab", "tpu", **pins))
    named = {n for command in plan for n in runtime.requirement_names(command)}
    assert named & set(runtime.KERAS3_KEEPS) == set()
    assert {"keras", "keras-hub", "tensorflow-cpu"} <= named  # 3.13.2 < 3.15; no TF at all
    assert "transformers" not in named  # Colab's 5.15 is a transformers 5
