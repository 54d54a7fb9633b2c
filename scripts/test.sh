#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite with a fresh Inductor cache.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup.sh"
cd "$ROOT"
TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
export TORCHINDUCTOR_CACHE_DIR
trap 'rm -rf "$TORCHINDUCTOR_CACHE_DIR"' EXIT
python -m pytest -q -p no:cacheprovider tests "$@"
