#!/usr/bin/env bash
# All tests, on both stacks: the unit tests, and every notebook run cell by cell by nbval
# with its CPU parameters (prepared by papermill into build/nbval-<stack>).
#
#   bash tools/test.sh                 # the CPU stack and the TPU stack, side by side
#   bash tools/test.sh --stack cpu     # one stack: cpu (.venv) or tpu (.venv-tpu)
#   bash tools/test.sh --stack tpu -k records    # further arguments go to pytest
#
# The TPU stack is Python 3.12 with tensorflow-tpu and libtpu, installed by the notebooks'
# own install plan for a Colab TPU runtime (see tools/env.sh); it runs on the CPU.
#
# Each stack's tests run as three pytest processes, and all six at once: its notebooks, its
# tests that train in new processes and kill them (resume), and its other unit tests (unit).
# Most of the work is single-threaded (Python, tracing, XLA compilation, new interpreters),
# and some of the time is spent waiting: on the package index (the install-plan dry runs)
# and 4 s in every new process of the TPU stack, whose TensorFlow build waits that long for
# a TPU before it settles for the CPU; six processes keep 2 cores busy through the waits,
# and three parts of about one size per stack end at about the same time. The environments
# and the offline fixtures are made first (see below); each part writes to
# build/test-<stack>-<part>.log and its own pytest temporary folder, and the logs are
# printed when all have ended.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stacks=(cpu tpu)
if [ "${1:-}" = "--stack" ]; then
  stacks=("$2")
  shift 2
fi
parts=(notebooks resume unit)
# the resume part: tests that start training processes, kill them and resume
RESUME_TESTS=(tests/test_checkpoints.py tests/test_pod.py tests/test_training.py)

# part STACK PART [PYTEST ARGS]: one stack's notebooks (nbval), resume tests or other unit tests.
part() {
  local stack="$1" part="$2"
  shift 2
  export STACK="$stack"
  source tools/env.sh
  rm -rf "build/pytest-$stack-$part"
  local targets=(tests) extra=()
  # The install-plan dry runs ask the package index about other runtimes, and the
  # exercise notebooks run to their first stub (cells that nbval runs on both stacks in
  # the solution notebooks); neither depends on the stack installed here, so one stack
  # runs each: the CPU stack the dry runs, the TPU stack the exercises, which keeps the
  # two about as long. The same holds for the parameter variants of a notebook (notebook
  # 01 on sentence pairs, CPU stack): its code paths run on both stacks with the main
  # ones. One stack alone runs everything.
  if [ "$part" = notebooks ]; then
    local variants=()
    if [ "${#stacks[@]}" -eq 2 ] && [ "$stack" = tpu ]; then
      variants=(--no-variants)
    fi
    rm -rf "build/nbval-$stack"
    python tools/run_notebooks.py --prepare-only --out "build/nbval-$stack" "${variants[@]}"
    targets=("build/nbval-$stack")
  elif [ "$part" = resume ]; then
    targets=("${RESUME_TESTS[@]}")
  elif [ "${#stacks[@]}" -eq 2 ] && [ "$stack" = tpu ]; then
    extra=(-m "not package_index")
  elif [ "${#stacks[@]}" -eq 2 ]; then
    extra=(-m "not exercise_run")
  fi
  if [ "$part" = unit ]; then
    local ignored
    for ignored in "${RESUME_TESTS[@]}"; do
      extra+=(--ignore "$ignored")
    done
  fi
  local status=0
  python -m pytest "${targets[@]}" --nbval-lax --nbval-current-env \
    --nbval-cell-timeout=900 -p no:cacheprovider --basetemp "build/pytest-$stack-$part" \
    --durations=25 "${extra[@]}" "$@" || status=$?
  # 5: nothing selected, which arguments such as -k can make of one part
  if [ "$status" -eq 5 ] && [ "$#" -gt 0 ]; then
    echo "nothing selected here by: $*"
    status=0
  fi
  return "$status"
}

# side_by_side STEP NAME JOB... -- [ARGS]: STEP JOB [ARGS] for every JOB at once (a JOB is
# "stack" or "stack part", words passed apart), each into build/NAME-<JOB joined by ->.log;
# the logs are printed when all have ended; fails if one did.
side_by_side() {
  local step="$1" name="$2" failed=0 job
  shift 2
  local jobs=()
  while [ "$1" != -- ]; do
    jobs+=("$1")
    shift
  done
  shift
  local -A pids
  for job in "${jobs[@]}"; do
    # shellcheck disable=SC2086  # a job's words are its arguments
    ("$step" $job "$@") > "build/$name-${job// /-}.log" 2>&1 &
    pids[$job]=$!
  done
  for job in "${jobs[@]}"; do
    wait "${pids[$job]}" || failed=1
  done
  for job in "${jobs[@]}"; do
    echo "=== $name, $job (build/$name-${job// /-}.log)"
    cat "build/$name-${job// /-}.log"
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

# A part, with its time, exit status and CPU time (of its processes) at the end of its log.
timed_part() {
  local start=$SECONDS status=0
  (part "$@") || status=$?
  times > "build/times-$1-$2"  # a builtin's own output: a pipe would run it in a subshell
  echo "=== $1 $2: $((SECONDS - start)) s, exit $status, CPU user and sys: $(tail -1 "build/times-$1-$2")"
  return "$status"
}

# The environments first, both at once (pip mostly unpacks wheels, each into its own
# folder: they took 160 s and 231 s one after the other on 2 cores).
mkdir -p build
side_by_side prepare env "${stacks[@]}" -- || {
  echo "an environment or the fixtures could not be made" >&2
  exit 1
}

jobs=()
for stack in "${stacks[@]}"; do
  for p in "${parts[@]}"; do
    jobs+=("$stack $p")
  done
done
start=$SECONDS
failed=0
side_by_side timed_part test "${jobs[@]}" -- "$@" || failed=1
echo "=== all tests (${stacks[*]}): $((SECONDS - start)) s side by side"
exit "$failed"
