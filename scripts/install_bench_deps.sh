#!/usr/bin/env bash
# Install the extras of `fbs bench` into the given Python's environment (idempotent).
# Usage: scripts/install_bench_deps.sh [PYTHON]   (default: python3; the Makefile passes the venv's python)
#
# - psutil: resident-set-size sampling and CPU facts recorded with every benchmark.
# - matplotlib: the PNG plot of decode latency vs layer-skip ratio (`fbs bench` skips the plot, with a
#   warning, when it is missing; tables and JSON need nothing beyond the core dependencies).
# - llama-cpp-python (opt-in, FBS_BENCH_LLAMA_CPP=1): the `llama-cpp` system. pip builds llama.cpp from
#   source (~6 min on 2 cores). The native build (AVX-512/AMX autodetected) crashed in the project's VM, so
#   those features are off and AVX2/FMA/F16C on. Without it the `llama-cpp` row is reported unavailable.
set -euo pipefail
PY="${1:-python3}"

# grep reads all of pip's output (grep -q could exit early and fail the pipe under pipefail)
has() { "$PY" -m pip show "$1" 2>/dev/null | grep "^Version: $2\$" >/dev/null; }

has psutil 7.2.2 || "$PY" -m pip install --quiet "psutil==7.2.2"
has matplotlib 3.11.2 || "$PY" -m pip install --quiet "matplotlib==3.11.2"
if [ "${FBS_BENCH_LLAMA_CPP:-0}" = "1" ] && ! has llama_cpp_python 0.3.36; then
  echo "building llama-cpp-python 0.3.36 from source (~6 min)"
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" "$PY" -m pip install --quiet "llama-cpp-python==0.3.36"
fi
echo "bench deps ready"
