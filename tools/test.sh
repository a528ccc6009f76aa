#!/usr/bin/env bash
# All tests, on both stacks: the unit tests, then every notebook run cell by cell by nbval
# with its CPU parameters (prepared by papermill into build/nbval-<stack>).
#
#   bash tools/test.sh                 # the CPU stack and the TPU stack, side by side
#   bash tools/test.sh --stack cpu     # one stack: cpu (.venv) or tpu (.venv-tpu)
#   bash tools/test.sh --stack tpu -k records    # further arguments go to pytest
#
# The TPU stack is Python 3.12 with tensorflow-tpu and libtpu, installed by the notebooks'
# own install plan for a Colab TPU runtime (see tools/env.sh); it runs on the CPU.
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
stacks=(cpu tpu)
if [ "${1:-}" = "--stack" ]; then
  stacks=("$2")
  shift 2
fi

leg() {
  local stack="$1"
  shift
  export STACK="$stack"
  source tools/env.sh
  rm -rf "build/nbval-$stack" "build/pytest-$stack"
  local extra=() variants=()
  # The install-plan dry runs ask the package index about other runtimes, and the
  # exercise notebooks run to their first stub (cells that nbval runs on both stacks in
  # the solution notebooks); neither depends on the stack installed here, so one leg
  # runs each: the CPU leg the dry runs, the TPU leg the exercises, which keeps the two
  # legs about as long. The same holds for the parameter variants of a notebook (notebook
  # 01 on sentence pairs, CPU leg): its code paths run on both legs with the main ones.
  # One stack alone runs everything.
  if [ "${#stacks[@]}" -eq 2 ] && [ "$stack" = tpu ]; then
    extra=(-m "not package_index")
    variants=(--no-variants)
  elif [ "${#stacks[@]}" -eq 2 ]; then
    extra=(-m "not exercise_run")
  fi
  # The runs users make: one replica (Colab's free TPU, one v5e chip; a CPU runtime) and
  # eight (Kaggle's v5e-8), each keeping the global batch of the parameter files (their
  # sizes); the CPU stack in float32, the TPU stack in bfloat16 (every notebook's
  # default). Eight simulated replicas cost about three times two on this CPU, most of
  # it in training cells (notebook 04's took 304 s at eight on the TPU stack), so each
  # stack runs some notebooks at eight and the rest at one, about as long each. Notebook 03 runs at one on both: at eight its pipeline benchmark
  # and profile cells alone take 12 minutes here (it passed at eight on 2026-12-02, in a
  # run of every notebook at eight). The main job (tools/run.sh) runs the parameter
  # files as written: two replicas, bfloat16.
  # The parameter variants (01 on sentence pairs) run at one.
  local eight=(01 05 06 07) one=(00 01_text_classification_fit.pairs 02 03 04)
  local precision=(--set mixed_bfloat16=false)
  if [ "$stack" = tpu ]; then
    eight=(00 02 04) one=(01 03 05 06 07) precision=()
  fi
  local replicas
  for replicas in 8 1; do
    local only=() n
    if [ "$replicas" = 8 ]; then
      for n in "${eight[@]}"; do only+=(--only "$n"); done
      only+=(--no-variants)
    else
      for n in "${one[@]}"; do only+=(--only "$n"); done
      only+=("${variants[@]}")
    fi
    python tools/run_notebooks.py --prepare-only --out "build/nbval-$stack" "${only[@]}" \
      --replicas "$replicas" "${precision[@]}"
  done
  python -m pytest tests "build/nbval-$stack" --nbval-lax --nbval-current-env \
    --nbval-cell-timeout=900 -p no:cacheprovider --basetemp "build/pytest-$stack" --durations=25 \
    "${extra[@]}" "$@"
}

# side_by_side STEP NAME [ARGS]: STEP "$stack" [ARGS] for every stack at once, each
# into build/NAME-<stack>.log; the logs are printed when all have ended; fails if one did.
side_by_side() {
  local step="$1" name="$2" failed=0
  shift 2
  local -A pids
  for stack in "${stacks[@]}"; do
    ("$step" "$stack" "$@") > "build/$name-$stack.log" 2>&1 &
    pids[$stack]=$!
  done
  for stack in "${stacks[@]}"; do
    wait "${pids[$stack]}" || failed=1
  done
  for stack in "${stacks[@]}"; do
    echo "=== $name, $stack stack (build/$name-$stack.log)"
    cat "build/$name-$stack.log"
  done
  return "$failed"
}

# An environment, and the offline fixtures with the first one as soon as it is there.
prepare() {
  STACK="$1" && source tools/env.sh
  if [ "$1" = "${stacks[0]}" ]; then
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
side_by_side prepare env || { echo "an environment or the fixtures could not be made" >&2; exit 1; }

if [ "${#stacks[@]}" -eq 1 ]; then  # one leg: its output as it goes
  timed_leg "${stacks[0]}" "$@"
  exit
fi

start=$SECONDS
failed=0
side_by_side timed_leg test "$@" || failed=1
echo "=== both stacks: $((SECONDS - start)) s side by side"
exit "$failed"
