#!/usr/bin/env bash
# Run convlower's compatibility tests on another torch, in its own venv.
#
#   bash bench/compat_torch.sh VERSION [pytest args...]
#   bash bench/compat_torch.sh 2.11.0                 # the default compat subset (below)
#   bash bench/compat_torch.sh 2.15.0 tests/test_backend.py -x
#
# Creates (or reuses) .venv-torch-VERSION in the repository root with torch==VERSION from the
# package index (on Linux a CUDA build: it imports and runs on CPU; several GB with its
# nvidia-* wheels), the rest of requirements-dev.txt without its torch pin, and convlower
# itself (`pip install --no-deps -e .`, so the `convlower` entry point is registered), then
# runs pytest with that venv and prints one verdict line:
#   compat torch 2.11.0: PASS (123 passed, 2 skipped) in 456 s
# Exit status: pytest's.  Not part of the default test run (the wheels are large).
# A torch below the supported range is refused when convlower is imported; to see what breaks
# there anyway: CONVLOWER_TRY_TORCH=1 bash bench/compat_torch.sh 2.6.0
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  echo "usage: bash bench/compat_torch.sh VERSION [pytest args...]" >&2
  exit 2
fi
VERSION=$1; shift
VENV=.venv-torch-$VERSION
PY=${PYTHON:-python3}
# The compatibility subset: rules (forward and backward), selection, the backend, Snake, dynamic
# shapes and guards, the per-version fallbacks; the slow model zoo / FSDP / spike tests are left out.
DEFAULT_TESTS=(tests/test_torch_versions.py tests/test_backend.py tests/test_patch_rules.py
               tests/test_conv3d_rules.py tests/test_selection.py tests/test_snake.py
               tests/test_dynamic_guards.py tests/test_emission.py tests/test_faults.py
               tests/test_bad_input.py)
[ $# -gt 0 ] || set -- "${DEFAULT_TESTS[@]}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[compat] creating $VENV" >&2
  "$PY" -m venv "$VENV" || exit 1
fi
# The one pin of this venv.  PIP_CONSTRAINT replaces any `constraint` from pip's config files
# (a machine may cap torch there) for the pip calls below only; other settings are kept.
echo "torch==$VERSION" > "$VENV/constraints.txt"
export PIP_CONSTRAINT="$VENV/constraints.txt"
stamp="$VENV/.convlower-installed"
want=$(cat pyproject.toml requirements-dev.txt "$VENV/constraints.txt" | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[compat] installing torch==$VERSION and the dev requirements into $VENV" >&2
  pip() { "$VENV/bin/python" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file" >&2); }
  pip "torch==$VERSION" || { echo "compat torch $VERSION: FAIL (torch==$VERSION could not be installed)"; exit 1; }
  grep -v -E '^[[:space:]]*torch([^a-zA-Z0-9_.-]|$)' requirements-dev.txt > "$VENV/requirements-dev.txt"
  pip -r "$VENV/requirements-dev.txt" || { echo "compat torch $VERSION: FAIL (dev requirements)"; exit 1; }
  pip --no-deps -e . || { echo "compat torch $VERSION: FAIL (pip install -e .)"; exit 1; }
  echo "$want" > "$stamp"
fi
unset PIP_CONSTRAINT

have=$("$VENV/bin/python" -c "import torch; print(torch.__version__)") || {
  echo "compat torch $VERSION: FAIL (torch does not import)"; exit 1; }
log="$VENV/pytest.log"
start=$(date +%s)
# This checkout's convlower first on the path (the venv's editable install may point at another
# checkout); an own decision cache per venv (decisions are not shared across torch versions).
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CONVLOWER_CACHE_DIR="$PWD/$VENV/convlower-cache" \
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
secs=$(( $(date +%s) - start ))
summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)|(passed|failed|error|skipped|deselected).* in [0-9.]+s' "$log" | tail -1 |
          sed -E 's/^=+ //; s/ =+$//; s/ in [0-9.]+s.*$//')
verdict=$([ "$rc" -eq 0 ] && echo PASS || echo FAIL)
echo "compat torch $have: $verdict (${summary:-no test summary, pytest exit $rc}) in $secs s"
exit "$rc"
