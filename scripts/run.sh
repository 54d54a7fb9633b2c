#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup.sh"
cd "$ROOT"
TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$ROOT/.cache/inductor}"
export TORCHINDUCTOR_CACHE_DIR
python -m specdec_inductor.demo "$@"
