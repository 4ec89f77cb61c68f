#!/usr/bin/env bash
# The main job: set up .venv if needed, then serve the embedded demo model on the OpenAI API
# (http://127.0.0.1:8000/v1). Extra arguments go to `ascendserve serve` (e.g. --port 8001, or a model).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh"
exec "$ROOT/.venv/bin/ascendserve" serve "$@"
