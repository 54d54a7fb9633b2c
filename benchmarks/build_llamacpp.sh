#!/usr/bin/env bash
# Builds the llama.cpp baseline of the quantized benchmarks from the source vendored in the
# llama-cpp-python sdist on PyPI (the same source bench_e2e's `pip install llama-cpp-python`
# compiles), with the build machine's native flags: llama-bench (plain decode), the speculative
# examples (draft-model speculation), llama-lookup (prompt lookup) and llama-server (the
# OpenAI-compatible server bench_serve.py compares against). Idempotent: binaries land in
# .cache/llamacpp/<version>/bin and are reused; a target added later builds on its own
# (incrementally in the kept build directory). Usage: bash benchmarks/build_llamacpp.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${LLAMACPP_PYTHON_VERSION:-0.3.36}"
DEST="$ROOT/.cache/llamacpp/$VERSION"
TARGETS=(llama-bench llama-speculative llama-speculative-simple llama-lookup llama-completion
         llama-server)
missing=0
for t in "${TARGETS[@]}"; do [ -x "$DEST/bin/$t" ] || missing=1; done
if [ "$missing" = 0 ]; then
  echo "$DEST/bin"; exit 0
fi
mkdir -p "$DEST"
if [ ! -d "$DEST/src" ]; then
  tmp="$(mktemp -d)"
  pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$tmp" >&2
  tar xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST/src"
  rm -rf "$tmp"
fi
cmake -S "$DEST/src" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$DEST/build" -j "${MAX_JOBS:-2}" --target "${TARGETS[@]}" >&2
mkdir -p "$DEST/bin"
for t in "${TARGETS[@]}"; do cp "$DEST/build/bin/$t" "$DEST/bin/"; done
echo "$DEST/bin"
