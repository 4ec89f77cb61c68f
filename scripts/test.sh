#!/usr/bin/env bash
# The test suite: set up .venv if needed, then run pytest. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest -p no:cacheprovider "$@"
