#!/usr/bin/env bash
# Create .venv in the repo root if missing and install ascendserve (+ test extras) into it.
# Re-installs only when pyproject.toml changed. Sourced by scripts/serve.sh and scripts/test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.ascendserve-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[setup] installing ascendserve and its dependencies into $VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[test]"
  echo "$WANT" > "$STAMP"
fi
