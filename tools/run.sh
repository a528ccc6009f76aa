#!/usr/bin/env bash
# The main job: execute every notebook on CPU with the offline fixtures and write
# build/notebooks/*.ipynb plus build/report/report.html.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python tools/run_notebooks.py "$@"
