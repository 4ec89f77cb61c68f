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
# tcmalloc: `ascendserve` restarts itself under it on CPU (ascendserve/cli/allocator.py; prefill page faults).
# Installed where this script may (root with apt-get); elsewhere one line says how, and glibc's malloc is used.
# (grep reads all of ldconfig's output: with -q it would exit early and pipefail would see ldconfig's SIGPIPE)
if ! ldconfig -p 2>/dev/null | grep 'libtcmalloc' >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing libtcmalloc-minimal4 (apt-get)"
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } \
      || echo "[setup] could not install libtcmalloc-minimal4: running with glibc's malloc"
  else
    echo "[setup] tcmalloc not found: 'apt install libtcmalloc-minimal4' (or your distro's gperftools) speeds up CPU prefill"
  fi
fi
