#!/usr/bin/env bash
# Device check for the attention kernels on an AMX machine (e.g. a 16-core Xeon, Python 3.12,
# torch preinstalled, no network): builds the extension in place, then runs the attention tests
# and the quick attention benchmark with the AMX and AVX-512 paths in turns. Every step has its
# own time limit (200 + 2x90 + 120 s) so the attention part fits in 9 minutes (two linear steps
# of 45 s follow); logs go to
# $OUT (or ./out). SPECDEC_SKIP_BUILD=1 reuses an extension already built in place.
# The AMX attention kernel (bf16; fp32 runs AVX-512 under SPECDEC_ISA=amx) was first proven on a
# 2-core AMX Xeon that served as a session's own machine (2026-12-01); this script repeats the
# proof on a bigger one. The tests run every path the machine supports and assert through
# kernel_path_counts() which one ran.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/out}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}"
status=0

step() {  # step NAME LIMIT_SECONDS COMMAND...: runs with a time limit, logs to $OUT/NAME.log
  local name="$1" limit="$2"
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  echo "== $name: rc=$rc in $((SECONDS - t0))s"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

{
  echo "host: $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo)"
  grep -o -w 'amx_tile\|amx_bf16\|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  "$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
} | tee "$OUT/env.log"

if [ -n "${SPECDEC_SKIP_BUILD:-}" ]; then
  echo "== build skipped (SPECDEC_SKIP_BUILD set): using the extension already built in place"
else
  step build 200 env MAX_JOBS="$(nproc)" "$PYTHON" setup.py build_ext --inplace || {
    echo "build failed: see $OUT/build.log"; exit 1; }
fi
"$PYTHON" -c "import specdec_inductor as s; print('detected', s.detected_isa(), 'built', s.built_isas()); print('C++ exceptions reach Python:', s.cpp_exceptions_work(), '-', s.cpp_exceptions_cause())" \
  | tee -a "$OUT/env.log"

if "$PYTHON" -c "import pytest" 2>/dev/null; then
  for isa in amx avx512; do
    # -rs lists skips: where C++ exceptions abort the process (tests/conftest.py), the tests
    # that make the library throw are skipped with the probe's cause instead of killing the run.
    step "test_attention_$isa" 90 env SPECDEC_ISA="$isa" "$PYTHON" -m pytest -q -rs -p no:cacheprovider \
      tests/test_attention.py
  done
else
  echo "pytest is not installed here: attention tests NOT run" | tee -a "$OUT/env.log"
  status=1
fi

# Without flex_attention: compiling it per shape does not fit this script's time budget. One run,
# the AMX and AVX-512 paths taking turns call by call (the "x avx512" column is their ratio).
step bench_attention_amx_vs_avx512 120 "$PYTHON" benchmarks/bench_attention.py \
  --quick --isa amx --vs-isa avx512 --no-flex
# Extra, after the attention proof (2 x 45 s more): the packed-weight skinny_linear kernel on
# this CPU and torch version, its tests and one-step GEMV timings (fp32 and bf16, M = 1, 8, 16).
step test_linear 45 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_linear.py -k "packed or matches"
step bench_linear 45 "$PYTHON" benchmarks/bench_linear.py --rows 1,8,16 --repeats 3
exit "$status"
