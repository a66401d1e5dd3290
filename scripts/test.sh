#!/usr/bin/env bash
# Set up .venv (CPU build of torch, pinned), install the system packages the real-component
# tests need when it can (root + apt-get: scripts/install-system-deps.sh), and run the whole
# test suite after the lint and type checks. Extra arguments go to pytest.
#
# The suite runs on parallel workers (pytest-xdist): its tests mostly wait on processes,
# sockets and timeouts, so twice as many workers as cores keep the cores busy.
# GRADSYNC_TEST_WORKERS sets their number (1: one process, no xdist).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# torch is pinned here (not in the package) so that pip takes the CPU build; Ray is pinned
# to a release with Python 3.11 wheels that the Ray tests were written against.
.venv/bin/pip install --quiet torch==2.13.0 "ray[train]==2.60.0" -e ".[test]"
# Not root: it says what is missing, the suite skips those tests and ends by counting them.
bash scripts/install-system-deps.sh || true
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# mypy runs beside pytest (its half minute overlaps the suite's start, which mostly waits);
# its report follows pytest's, and either failing fails the run.
typecheck_log=$(mktemp)
PYTHON="$PWD/.venv/bin/python" scripts/typecheck.sh >"$typecheck_log" 2>&1 &
typecheck=$!
workers="${GRADSYNC_TEST_WORKERS:-$((2 * $(nproc)))}"
if [ "$workers" -gt 1 ]; then
  set -- -n "$workers" --dist loadgroup "$@"
fi
status=0
.venv/bin/python -m pytest "$@" || status=$?
wait "$typecheck" || { status=1; echo "scripts/typecheck.sh failed:"; }
cat "$typecheck_log"
rm -f "$typecheck_log"
exit "$status"
