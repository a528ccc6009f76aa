# Sourced by tools/run.sh and tools/test.sh: create the virtual environment of a stack if it
# is missing or stale, then activate it.
#
#   STACK=cpu (default)  .venv      Python 3.11 + requirements.txt (TensorFlow 2.21, CPU build)
#   STACK=tpu            .venv-tpu  Python 3.12, the TF engine with tensorflow-tpu: start from
#                                   a TPU runtime's Python without TensorFlow (transformers
#                                   5, datasets 5.2; tools/tf-tpu-start-image.txt), then run
#                                   tpu_helpers' own install plan for the TF engine on a TPU
#                                   (tensorflow-tpu, the pinned libtpu, tf-keras --no-deps,
#                                   the Hugging Face pins). No TPU is needed: the TPU build
#                                   runs on the CPU.
#   STACK=colab          .venv-colab  Python 3.13, made the way Colab's TPU runtime ships
#                                   today (tools/colab-tpu-image.txt: JAX 0.7.2, Keras
#                                   3.13.2, transformers 5.15, no TensorFlow), then the
#                                   Keras 3 engine's install plan as the install cell runs it
#                                   there; the freeze before and after is kept and the plan
#                                   may not touch JAX, numpy, protobuf or h5py.
#   STACK=keras3         .venv-keras3  Python 3.12, made the way Kaggle's TPU image is:
#                                   tensorflow-cpu, JAX (CPU here), Keras 3, transformers 5
#                                   (tools/kaggle-tpu-image.txt), then tpu_helpers' install
#                                   plan for the Keras 3 engine on a Kaggle TPU (KerasHub).
#                                   JAX sees 8 CPU devices (XLA_FLAGS), as a v5e-8 has chips,
#                                   run by 16 threads (PJRT_NPROC: keras3.simulation_env).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STACK="${STACK:-cpu}"

# The pins of requirements.txt that are not the TensorFlow / Hugging Face stack: test and
# notebook tooling, which a Colab image has in some version anyway.
tooling_requirements() {
  grep -v -E '^(tensorflow|tf-keras|tensorboard|tensorboard-plugin-profile|transformers|tokenizers|datasets|huggingface-hub)==' \
    requirements.txt
}

case "$STACK" in
  cpu)
    VENV=.venv
    PYTHON="${PYTHON:-python3}"
    inputs="requirements.txt pyproject.toml"
    ;;
  tpu)
    VENV=.venv-tpu
    PYTHON="${PYTHON_TPU:-python3.12}"
    export PYENV_VERSION="${PYENV_VERSION:-3.12.1}"  # pyenv machines: the 3.12 interpreter
    inputs="requirements.txt pyproject.toml tools/tf-tpu-start-image.txt tpu_helpers/runtime/__init__.py"
    ;;
  colab)
    VENV=.venv-colab
    image=tools/colab-tpu-image.txt
    PYTHON="${PYTHON_COLAB:-python$(sed -n 's/^# python: //p' "$image")}"
    export PYENV_VERSION="${PYENV_VERSION_COLAB:-3.13.0}"
    inputs="requirements.txt pyproject.toml $image tpu_helpers/runtime/__init__.py"
    ;;
  keras3)
    VENV=.venv-keras3
    PYTHON="${PYTHON_TPU:-python3.12}"
    export PYENV_VERSION="${PYENV_VERSION:-3.12.1}"
    inputs="requirements.txt pyproject.toml tools/kaggle-tpu-image.txt tpu_helpers/runtime/__init__.py"
    ;;
  *)
    echo "STACK must be cpu, tpu, keras3 or colab, not '$STACK'" >&2
    exit 2
    ;;
esac

# The tooling pins without those of the packages an image file names (the image's win).
tooling_beside() {
  local names
  names="$(grep -v '^#' "$1" | sed -E 's/[][<>=~!;[:space:]].*//' | tr 'A-Z_' 'a-z-' | paste -sd'|')"
  tooling_requirements | grep -v -i -E "^($names)=="
}

# pip, without the lines this machine's pip configuration adds for index folders it lacks
pip_in() {
  local venv="$1"
  shift
  "$venv/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor" >&2)
}

# The environments are made by uv (a pinned release, fetched once into build/): the same
# exact pins, installed in a tenth of pip's time (requirements.txt on 2 cores, 2026-12-07:
# 16 s against 176 s). uv reads PyPI only, not pip's configuration (this machine's extra
# folders hold nothing the pins need). pip stays in each environment (--seed), for the
# install cells, which run pip as they do on Colab and Kaggle.
UV_PIN=uv==0.13.10
export UV_PYTHON_DOWNLOADS=never  # the stack's own interpreter, or a clear failure
uv_bin() {
  local uv="$ROOT/build/${UV_PIN/==/-}/uv"
  if [ ! -x "$uv" ]; then  # the four stacks are made at once: each fetches, one file wins
    local fetched
    fetched="$(mktemp -d "$ROOT/build/uv-fetch.XXXXXX")"
    python3 -m pip install -q --no-deps --target "$fetched" "$UV_PIN" \
      2> >(grep -v "is ignored: it is neither a file nor" >&2) >&2 || return 1
    mkdir -p "$(dirname "$uv")"
    mv -f "$fetched/bin/uv" "$uv"
    rm -rf "$fetched"
  fi
  echo "$uv"
}

# uv pip install into an environment: install_in VENV ARGS...
install_in() {
  local venv="$1" uv
  shift
  uv="$(uv_bin)" && "$uv" pip install -q --python "$venv/bin/python" "$@"
}

# A step that failed while making the environment: nothing half-made is kept. (This file is
# sourced where bash ignores set -e: after `||` and `&&`.)
env_failed() {
  echo "[env] $STACK: $1 failed; $VENV removed" >&2
  rm -rf "$VENV"
  exit 1
}

stamp="$VENV/.requirements.sha"
want="$(cat $inputs tools/env.sh | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[env] creating $VENV (stack: $STACK; a few minutes the first time)"
  rm -rf "$VENV"
  mkdir -p build
  interpreter="$(command -v "$PYTHON")" || env_failed "finding $PYTHON"
  uv="$(uv_bin)" || env_failed "fetching $UV_PIN"
  "$uv" venv -q --seed --python "$interpreter" "$VENV" || env_failed "uv venv"
  if [ "$STACK" = cpu ]; then
    install_in "$VENV" -r requirements.txt || env_failed "installing"
    install_in "$VENV" --no-deps -e . || env_failed "installing"
  elif [ "$STACK" = keras3 ]; then
    install_in "$VENV" -r tools/kaggle-tpu-image.txt -r <(tooling_requirements) \
      || env_failed "installing"
    install_in "$VENV" --no-deps -e . || env_failed "installing"
    # What the main track's install cell runs on a Kaggle TPU runtime, through the same function.
    KAGGLE_KERNEL_RUN_TYPE=rehearsal TPU_ACCELERATOR_TYPE=v5litepod-8 \
      "$VENV/bin/python" -m tpu_helpers install --engine keras3 2> >(grep -v "is ignored: it is neither" >&2) \
      || env_failed "the install cell"
    "$VENV/bin/python" -c "import keras_hub, keras; print('[env] Keras 3 stack: keras', keras.__version__, 'keras-hub', keras_hub.__version__)" \
      || env_failed "importing Keras 3"
  elif [ "$STACK" = colab ]; then
    install_in "$VENV" -r "$image" -r <(tooling_beside "$image") || env_failed "installing"
    install_in "$VENV" --no-deps -e . || env_failed "installing"
    pip_in "$VENV" freeze --all > "$VENV/freeze-image.txt"
    echo "[env] pip freeze before the install cell ($VENV/freeze-image.txt):"
    sed 's/^/    /' "$VENV/freeze-image.txt"
    # The install cell as it runs on Colab with a TPU (detect_runtime reads these two
    # variables so); it raises if it changed what the runtime keeps (runtime.KERAS3_KEEPS),
    # and here anything else the plan does not name fails the leg too.
    COLAB_RELEASE_TAG=rehearsal TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_SKIP_MDS_QUERY=1 \
      "$VENV/bin/python" -c 'import tpu_helpers
from tpu_helpers import runtime
before = runtime.installed()
plan = tpu_helpers.install(engine="keras3")
unplanned = runtime.unplanned_changes(runtime.install_changes(before, runtime.installed()), plan)
assert not unplanned, f"the install cell changed what its plan does not name: {unplanned}"' \
      2> >(grep -v "is ignored: it is neither" >&2) || env_failed "the install cell"
    pip_in "$VENV" freeze --all > "$VENV/freeze-installed.txt"
    echo "[env] the install cell changed (diff of pip freeze, image -> installed):"
    diff "$VENV/freeze-image.txt" "$VENV/freeze-installed.txt" | grep '^[<>]' || true
    KERAS_BACKEND=jax "$VENV/bin/python" - "$image" <<'PY' || env_failed "the stack's check"
import sys
import jax, keras, keras_hub
from tpu_helpers.runtime import installed
image = {}
for line in open(sys.argv[1]):
    if "==" in line and not line.startswith("#"):
        name, version = line.split("==")
        image[name.split("[")[0].strip().lower()] = version.strip()
have = installed()
for kept in ("jax", "jaxlib", "numpy", "protobuf", "h5py"):
    assert have[kept] == image[kept], f"{kept} {image[kept]} became {have[kept]}"
print(f"[env] Colab stack: Python {sys.version.split()[0]}, jax {jax.__version__},"
      f" keras {keras.__version__}, keras-hub {keras_hub.__version__},"
      f" transformers {have['transformers']}, tensorflow-cpu {have.get('tensorflow-cpu')}")
PY
  else
    install_in "$VENV" -r tools/tf-tpu-start-image.txt -r <(tooling_requirements) \
      || env_failed "installing"
    install_in "$VENV" --no-deps -e . || env_failed "installing"
    # What the notebooks' install cell runs on a Colab TPU runtime, through the same
    # function: detect_runtime() reads these two variables as "Colab, with a TPU".
    COLAB_RELEASE_TAG=rehearsal TPU_ACCELERATOR_TYPE=v5litepod-1 TPU_SKIP_MDS_QUERY=1 \
      "$VENV/bin/python" -m tpu_helpers install 2> >(grep -v "is ignored: it is neither" >&2) \
      || env_failed "the install cell"
    "$VENV/bin/python" - <<'PY' || env_failed "the stack's check"
from importlib import metadata
from tpu_helpers.runtime import LIBTPU_PIN, TENSORFLOW_TPU_PIN
have = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in metadata.distributions()}
for pin in (TENSORFLOW_TPU_PIN, LIBTPU_PIN):
    name, version = pin.split("==")
    assert have.get(name) == version, f"the install plan left {name} {have.get(name)}, not {version}"
assert "tensorflow" not in have and "tensorflow-cpu" not in have, "a second TensorFlow build"
print("[env] TPU stack:", {n: have.get(n) for n in ("tensorflow-tpu", "libtpu", "tf-keras",
      "transformers", "datasets", "huggingface-hub")})
PY
  fi
  "$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null \
    || env_failed "the kernel's install"
  echo "$want" > "$stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "$STACK" = keras3 ] || [ "$STACK" = colab ]; then
  export KERAS_BACKEND=jax
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
  export PJRT_NPROC=16  # two threads per device, as keras3.simulation_env sets (it says why)
fi
# cheap_compiles: XLA's CPU backend with LLVM's cheap passes only, for the runs of tiny
# models that spend more CPU compiling than computing (the Keras 3 legs of the tests); the
# main job, whose notebooks 05 and 09 time compiled steps, and the benchmarks keep the
# default optimization. Measured alone on 2 cores
# (2026-12-06): notebook 02 at one device 96 s of CPU against 150 s, three engine tests
# 60 s against 77 s; the same checks pass.
cheap_compiles() {
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
}
if [ "$STACK" = tpu ]; then
  # Off a TPU VM the TPU build would wait minutes on cloud metadata at import.
  export TPU_SKIP_MDS_QUERY=1
fi
