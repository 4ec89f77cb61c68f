#!/usr/bin/env bash
# The main job: set up .venv if needed, then run ascendserve on the embedded demo model.
# Extra arguments go to the command (e.g. --port 8000).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh"
if "$ROOT/.venv/bin/ascendserve" serve --help >/dev/null 2>&1; then
  exec "$ROOT/.venv/bin/ascendserve" serve "$@"
fi
exec "$ROOT/.venv/bin/ascendserve" generate "What is the capital of France?" "$@"
