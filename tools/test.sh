#!/usr/bin/env bash
# All tests, on every stack: the unit tests, then every notebook run cell by cell by nbval
# with its CPU parameters (prepared by papermill into build/nbval-<stack>).
#
#   bash tools/test.sh                 # the three stacks, side by side
#   bash tools/test.sh --stack cpu     # one stack: cpu (.venv), tpu (.venv-tpu), keras3
#   bash tools/test.sh --stack tpu -k records    # further arguments go to pytest
#
# The TPU stack is Python 3.12 with tensorflow-tpu and libtpu, installed by the notebooks'
# own install plan for a Colab TPU runtime (see tools/env.sh); it runs on the CPU. The
# Keras 3 stack is Python 3.12 shaped like Kaggle's TPU image (JAX, Keras 3,
# transformers 5, tensorflow-cpu), completed by notebook 08's install plan; JAX sees 8
# CPU devices. Its leg runs the Keras 3 engine's tests and notebook 08 (see keras3_leg).
#
# Both legs run at once: most of a leg's time is single-threaded (Python, tracing, XLA
# compilation, new interpreters), so on a 2-core machine one leg used about one core.
# Splitting each leg into more pytest processes was slower on 2 cores: with six (each
# stack's notebooks, resume tests and other tests), three parts were still running after
# 31 minutes, where the two legs took 30.7; more processes than cores make TensorFlow's
# thread pools and the new interpreters compete for the same cores. The
# environments and the offline fixtures are made first (see below); each leg then writes
# to build/test-<stack>.log and its own pytest temporary folder, and the logs are printed
# when both have ended.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stacks=(cpu tpu keras3)
if [ "${1:-}" = "--stack" ]; then
  stacks=("$2")
  shift 2
fi

leg() {
  local stack="$1"
  shift
  if [ "$stack" = keras3 ]; then  # its environment too is made at the lower priority
    renice -n 19 -p "$BASHPID" > /dev/null
  fi
  export STACK="$stack"
  source tools/env.sh
  rm -rf "build/nbval-$stack" "build/pytest-$stack"
  if [ "$stack" = keras3 ]; then
    keras3_leg "$@"
    return
  fi
  local extra=()
  # The install-plan dry runs ask the package index about other runtimes, and the
  # exercise notebooks run to their first stub (cells that nbval runs on both stacks in
  # the solution notebooks); neither depends on the stack installed here, so one leg
  # runs each: the TPU leg the dry runs, the CPU leg the exercises (110 s), which keeps
  # the two legs about as long. A pod slice runs the TPU stack, so its simulated two-host
  # slice (90 s) runs on the TPU leg. One stack alone runs everything.
  if both_tf_stacks && [ "$stack" = tpu ]; then
    extra=(-m "not exercise_run")
  elif both_tf_stacks; then
    extra=(-m "not package_index and not pod_slice")
  fi
  # The runs users make: one replica (Colab's free TPU, one v5e chip; a CPU runtime) and
  # eight (Kaggle's v5e-8), each keeping the global batch of the parameter files (their
  # sizes); the CPU stack in float32, the TPU stack in bfloat16 (every notebook's
  # default). The main job (tools/run.sh) runs the parameter files as written: two
  # replicas, bfloat16. A run of every notebook at eight (--replicas 8) passed on
  # 2026-12-02; here each leg runs a few notebooks at eight, the rest at one.
  #
  # Eight simulated replicas cost tracing more than computing: MirroredStrategy builds the
  # step's graph once per replica, one replica at a time in Python, for every new input
  # shape, where a TPU traces it once. 01's pairs at eight, alone on 2 cores
  # (2026-12-03): first epoch 121 s with four widths, second 11 s. So the notebooks at
  # eight are chosen for what they add and for time: 01 on its sentence-pair variant (the
  # same cells on 3,668 MRPC-like rows; CoLA-like at eight took 183 s alone); 03, 04, 05,
  # 06 and 09 only at one (at eight: 09's pipeline benchmark and profile 12 minutes, 04's
  # training 304 s, 05's XLA table 149 s), and 02 too: in the CI rehearsal of 2026-12-03
  # (1946 s, over the 30 minutes the whole run may take) 02 at eight took 612 s in its
  # two training cells and made its leg the last by six minutes. Its loss scaling is
  # judged for 1, 2 and 8 replicas in tests/test_workshop.py; the loop itself runs at two
  # in the tests and the main job, and at one here.
  local eight=(07) one=(00 01 02 03 04 05 06 09)
  local precision=(--set mixed_bfloat16=false)
  if [ "$stack" = tpu ]; then
    eight=(00 01_text_classification_fit.pairs) one=(01 02 03 04 05 06 07 09) precision=()
  fi
  local replicas
  for replicas in 8 1; do
    local only=() n
    if [ "$replicas" = 8 ]; then
      for n in "${eight[@]}"; do only+=(--only "$n"); done
    else
      for n in "${one[@]}"; do only+=(--only "$n"); done
      only+=(--no-variants)
    fi
    python tools/run_notebooks.py --prepare-only --engine tf --out "build/nbval-$stack" \
      "${only[@]}" --replicas "$replicas" "${precision[@]}"
  done
  python -m pytest tests "build/nbval-$stack" --nbval-lax --nbval-current-env \
    --nbval-cell-timeout=900 -p no:cacheprovider --basetemp "build/pytest-$stack" --durations=25 \
    "${extra[@]}" "$@"
}

both_tf_stacks() {
  [[ " ${stacks[*]} " == *" cpu "* && " ${stacks[*]} " == *" tpu "* ]]
}

# The Keras 3 leg: the engine's tests (against the TF engine's numbers in the fixtures,
# at eight devices, Kaggle's v5e-8, kill and resume included), the engine choice and
# install plans, the exercise edition of notebook 08 to its first stub, and notebook 08
# cell by cell at one device (Colab's v5e-1, whose TPU runtime ships JAX and no
# TensorFlow), in bfloat16 (its default). Notebook 08 at eight passed here on 2026-12-03
# (183 s of its cells in CI beside the other legs); it runs there in a run of every
# notebook at eight. It runs beside the two TensorFlow legs at the lowest
# priority, its environment made there too (three environments made at once took 196 s
# before any leg started, two 128 s): the TensorFlow legs leave a core idle for minutes
# at a time (single-threaded tracing and compiling), which this leg takes. Alone it took
# 401 s and 10 minutes of CPU; beside them, 952 s, and the three legs 1656 s. JAX's persistent compilation cache lives for the leg
# (the text part's compilations serve the records part: 162 s to 100 s for notebook 08).
keras3_leg() {
  export JAX_COMPILATION_CACHE_DIR="$PWD/build/jax-cache"
  rm -rf "$JAX_COMPILATION_CACHE_DIR"
  python tools/run_notebooks.py --prepare-only --engine keras3 --out build/nbval-keras3 \
    --replicas 1
  python -m pytest tests/test_keras3.py tests/test_runtime.py tests/test_exercises.py \
    build/nbval-keras3 --nbval-lax --nbval-current-env --nbval-cell-timeout=900 \
    -p no:cacheprovider --basetemp build/pytest-keras3 --durations=15 "$@"
}

# side_by_side STEP NAME [ARGS]: STEP "$stack" [ARGS] for every stack of run_stacks at
# once, each into build/NAME-<stack>.log; the logs are printed when all have ended; fails if one did.
side_by_side() {
  local step="$1" name="$2" failed=0
  shift 2
  local -A pids
  for stack in "${run_stacks[@]}"; do
    ("$step" "$stack" "$@") > "build/$name-$stack.log" 2>&1 &
    pids[$stack]=$!
  done
  for stack in "${run_stacks[@]}"; do
    wait "${pids[$stack]}" || failed=1
  done
  for stack in "${run_stacks[@]}"; do
    echo "=== $name, $stack stack (build/$name-$stack.log)"
    cat "build/$name-$stack.log"
  done
  return "$failed"
}

# An environment, and the offline fixtures with the first one as soon as it is there.
# The fixtures hold the TF engine's reference numbers, so a Keras 3 leg alone builds them
# in the CPU stack.
prepare() {
  if [ "$1" = keras3 ] && [ "${#stacks[@]}" -eq 1 ]; then  # in a shell of its own
    env -u PYENV_VERSION -u PYTHON STACK=cpu bash -c \
      'source tools/env.sh && python -m tpu_helpers fixtures build/fixtures'
  fi
  STACK="$1" && source tools/env.sh
  if [ "$1" = "${stacks[0]}" ] && [ "$1" != keras3 ]; then
    python -m tpu_helpers fixtures build/fixtures
  fi
}

# A leg, with its time, exit status and CPU time (of its processes) at the end of its log.
timed_leg() {
  local leg_start=$SECONDS status=0
  (leg "$@") || status=$?
  times > "build/times-$1"  # a builtin's own output: a pipe would run it in a subshell
  echo "=== $1 stack: $((SECONDS - leg_start)) s, exit $status, CPU user and sys: $(tail -1 "build/times-$1")"
  return "$status"
}

# The environments first, both at once (pip mostly unpacks wheels, each into its own
# folder: they took 160 s and 231 s one after the other on 2 cores).
mkdir -p build
run_stacks=("${stacks[@]}")
if [ "${#stacks[@]}" -gt 1 ]; then
  run_stacks=(cpu tpu)  # the Keras 3 environment is made in its own leg, at its priority
fi
side_by_side prepare env || { echo "an environment or the fixtures could not be made" >&2; exit 1; }
run_stacks=("${stacks[@]}")

if [ "${#stacks[@]}" -eq 1 ]; then  # one leg: its output as it goes
  timed_leg "${stacks[0]}" "$@"
  exit
fi

start=$SECONDS
failed=0
side_by_side timed_leg test "$@" || failed=1
echo "=== all stacks: $((SECONDS - start)) s side by side"
exit "$failed"
