#!/usr/bin/env bash
# The main job: execute the main track's notebooks (notebooks/: Keras 3 and KerasHub on
# JAX, what Colab's and Kaggle's TPU runtimes run) on CPU with the offline fixtures and
# write build/notebooks/*.ipynb plus build/report/report.html, all in the Keras 3 stack
# (the offline fixtures need no TensorFlow engine). With --seeds, the seeds' track
# (notebooks/tf/, the TF engine) runs first in the CPU stack, into build/notebooks/tf/, and
# the report holds both tracks (the tests run both tracks anyway). Each notebook runs once, on
# its parameter file (tests/params/<notebook>.yaml); with --variants, its variants too
# (<notebook>.<variant>.yaml: sentence pairs, other model families), about 15 minutes on 2
# cores where the notebooks alone take about 6 (CI runs some of them: tools/test.sh). Other
# arguments go to tools/run_notebooks.py (--only 01); a failed seeds' notebook does not stop
# the main track, and the exit status says whether any failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seeds=0
variants=(--no-variants)
args=()
for arg in "$@"; do
  case "$arg" in
    --seeds) seeds=1 ;;
    --variants) variants=() ;;
    *) args+=("$arg") ;;
  esac
done
args+=("${variants[@]}")
status=0
report=()
if [ "$seeds" = 1 ]; then
  (STACK=cpu && source tools/env.sh &&
    python tools/run_notebooks.py --engine tf --none-ok "${args[@]}") || status=$?
  report=(--report-all)
fi
(STACK=keras3 && source tools/env.sh &&
  python tools/run_notebooks.py --engine keras3 "${report[@]}" "${args[@]}") || status=$?
exit "$status"
