#!/usr/bin/env bash
# One entry point for a newcomer:  scripts/dev.sh main   |   scripts/dev.sh test [pytest args]
# Creates .venv on first use. torch is installed first as the pinned CPU build when none is present,
# so pip never pulls a multi-GB CUDA wheel on a CPU-only machine; a torch already in the venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${BCG_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.bcg-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==${BCG_TORCH_VERSION:-2.13.0}"
  fi
  "$PY" -m pip install -q -e ".[test]"
  touch "$stamp"
fi
cmd=${1:-test}; shift || true
case "$cmd" in
  main) exec "$PY" -m deployments.demo "$@" ;;
  test) exec "$PY" -m pytest -q "$@" ;;
  *) echo "usage: scripts/dev.sh main|test [args]" >&2; exit 2 ;;
esac
