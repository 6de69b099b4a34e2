#!/usr/bin/env bash
# Install the extras of `fbs bench` into the given Python's environment (idempotent).
# Usage: scripts/install_bench_deps.sh [PYTHON]   (default: python3; the Makefile passes the venv's python)
#
# - psutil: resident-set-size sampling and CPU facts recorded with every benchmark.
# - matplotlib: the PNG plot of decode latency vs layer-skip ratio (`fbs bench` skips the plot, with a
#   warning, when it is missing; tables and JSON need nothing beyond the core dependencies).
# llama.cpp, the `llama-cpp-*` systems, is built by the opt-in scripts/build_llama_cpp.sh (its own tools, with the
# instruction sets this CPU has); this script no longer installs llama-cpp-python.
set -euo pipefail
PY="${1:-python3}"

# grep reads all of pip's output (grep -q could exit early and fail the pipe under pipefail)
has() { "$PY" -m pip show "$1" 2>/dev/null | grep "^Version: $2\$" >/dev/null; }

has psutil 7.2.2 || "$PY" -m pip install --quiet "psutil==7.2.2"
has matplotlib 3.11.2 || "$PY" -m pip install --quiet "matplotlib==3.11.2"
echo "bench deps ready"
