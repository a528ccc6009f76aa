#!/usr/bin/env bash
# The main job: execute every notebook on CPU with the offline fixtures and write
# build/notebooks/*.ipynb plus build/report/report.html: the seeds' track (notebooks/tf/,
# into build/notebooks/tf/) in the CPU stack (the TF engine; it also builds the fixtures,
# whose reference numbers come from that engine), then the main track (notebooks/) in the
# Keras 3 stack (Keras 3 and KerasHub on JAX); one report of both. Arguments go to both
# runs (tools/run_notebooks.py); a failed notebook in the first does not stop the second,
# and the exit status says whether any failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
status=0
(STACK=cpu && source tools/env.sh && python tools/run_notebooks.py --engine tf "$@") || status=$?
(STACK=keras3 && source tools/env.sh &&
  python tools/run_notebooks.py --engine keras3 --report-all "$@") || status=$?
exit "$status"
