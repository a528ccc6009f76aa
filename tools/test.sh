#!/usr/bin/env bash
# All tests, on both stacks: the unit tests, then every notebook run cell by cell by nbval
# with its CPU parameters (prepared by papermill into build/nbval-<stack>).
#
#   bash tools/test.sh                 # the CPU stack, then the TPU stack
#   bash tools/test.sh --stack cpu     # one stack: cpu (.venv) or tpu (.venv-tpu)
#   bash tools/test.sh --stack tpu -k records    # further arguments go to pytest
#
# The TPU stack is Python 3.12 with tensorflow-tpu and libtpu, installed by the notebooks'
# own install plan for a Colab TPU runtime (see tools/env.sh); it runs on the CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stacks=(cpu tpu)
if [ "${1:-}" = "--stack" ]; then
  stacks=("$2")
  shift 2
fi
for stack in "${stacks[@]}"; do
  echo "=== tests on the $stack stack"
  start=$SECONDS
  (
    export STACK="$stack"
    source tools/env.sh
    rm -rf "build/nbval-$stack"
    extra=()
    variants=()
    # The install-plan dry runs ask the package index about other runtimes, and the
    # exercise notebooks run to their first stub (cells that nbval runs on both stacks in
    # the solution notebooks); neither depends on the stack installed here, so one leg
    # runs them. The same holds for the parameter variants of a notebook (notebook 01 on
    # sentence pairs): the notebook's code paths run on both legs with its main parameters.
    if [ "$stack" = tpu ]; then
      extra=(-m "not package_index and not exercise_run")
      variants=(--no-variants)
    fi
    python tools/run_notebooks.py --prepare-only --out "build/nbval-$stack" "${variants[@]}"
    python -m pytest tests "build/nbval-$stack" --nbval-lax --nbval-current-env \
      --nbval-cell-timeout=900 -p no:cacheprovider "${extra[@]}" "$@"
  )
  echo "=== $stack stack: $((SECONDS - start)) s"
done
