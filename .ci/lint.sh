#!/usr/bin/env bash
# Lint, format and type checks; exits non-zero on any finding. Seconds, offline.
# Needs the lint extra: pip install -e '.[lint]'   (configuration: pyproject.toml)
# To fix what can be fixed mechanically: bash .ci/lint.sh --fix
set -uo pipefail
cd "$(dirname "$0")/.."
PY_DIRS=(logit_dp tests benchmarks experiments)

if [[ "${1:-}" == "--fix" ]]; then
  yapf --in-place --recursive --parallel "${PY_DIRS[@]}"
  ruff check --fix .
  yapf --in-place --recursive --parallel "${PY_DIRS[@]}"  # re-wrap what the fixes touched
fi

status=0
echo "== ruff check (lint, import order, docstrings and return types of the public API)"
ruff check . || status=1
echo "== yapf (format; the diff below is what 'bash .ci/lint.sh --fix' would change)"
yapf --diff --recursive --parallel "${PY_DIRS[@]}" || status=1
echo "== pyright (types of logit_dp/)"
pyright || status=1
if [[ $status -ne 0 ]]; then echo "lint: FAILED"; else echo "lint: ok"; fi
exit $status
