#!/usr/bin/env bash
# All tests: unit tests, then every notebook run cell by cell by nbval with its CPU
# parameters (prepared by papermill into build/nbval).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
rm -rf build/nbval
python tools/run_notebooks.py --prepare-only --out build/nbval
exec python -m pytest tests build/nbval --nbval-lax --nbval-current-env \
  --nbval-cell-timeout=900 -p no:cacheprovider "$@"
