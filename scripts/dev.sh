#!/usr/bin/env bash
# One entry point for a newcomer:  scripts/dev.sh main   |   scripts/dev.sh test [pytest args]
# `test` runs the suite but its `slow` tier (benchmark scripts run end to end over Serve, fresh processes
# that compile); `test -m slow` runs that tier alone (CI runs both: .ci/run).
# Creates .venv on first use. torch is installed first when none is present: on a machine without an
# NVIDIA GPU (no nvidia-smi) the pinned CPU build from PyTorch's CPU wheel index (PyPI's Linux wheel is
# the multi-GB CUDA build), PyPI's where that index cannot be reached or there is a GPU; a torch already
# in the venv is kept.
set -euo pipefail
# what `test` says before it starts: the whole CPU suite's time (edit when measured again)
SUITE_TIME="about 10 minutes on a 2-CPU machine (588 s of tests in CI, plus the first set-up; the slow tier, -m slow, 502 s more)"
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
    torch_pin="torch==${BCG_TORCH_VERSION:-2.13.0}"
    cpu_index=${BCG_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
    if command -v nvidia-smi >/dev/null 2>&1; then
      "$PY" -m pip install -q "$torch_pin"
    elif "$PY" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1] + '/torch/', timeout=10)" \
        "$cpu_index" >/dev/null 2>&1; then  # reachable: torch and its dependencies from there
      "$PY" -m pip install -q "$torch_pin" --index-url "$cpu_index"
    else
      echo "dev.sh: no GPU, but $cpu_index is unreachable: torch from PyPI (or pip's own index)" >&2
      "$PY" -m pip install -q "$torch_pin"
    fi
  fi
  "$PY" -m pip install -q -e ".[test]"
  touch "$stamp"
fi
cmd=${1:-test}; shift || true
case "$cmd" in
  main) exec "$PY" -m deployments.demo "$@" ;;
  test)
    echo "dev.sh test: the CPU suite takes $SUITE_TIME; pytest args run part of it (e.g. tests/bcg, -m slow)"
    exec "$PY" -m pytest -q -m "not slow" "$@" ;;
  *) echo "usage: scripts/dev.sh main|test [args]" >&2; exit 2 ;;
esac
