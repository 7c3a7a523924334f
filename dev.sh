#!/usr/bin/env bash
# One entry point for a fresh machine: creates/refreshes .venv, then runs what you ask.
#   bash dev.sh demo   -> set up, then a compile spike on the built-in default model
#   bash dev.sh test   -> set up, then the test suite
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[convlower] creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.convlower-installed
want=$(cat pyproject.toml requirements-dev.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[convlower] installing dependencies into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  .venv/bin/python -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
fi
cmd=${1:-test}; shift || true
case "$cmd" in
  demo) exec .venv/bin/python -m convlower spike "$@" ;;
  test) exec .venv/bin/python -m pytest -q "$@" ;;
  *) echo "usage: bash dev.sh demo|test [args...]" >&2; exit 2 ;;
esac
