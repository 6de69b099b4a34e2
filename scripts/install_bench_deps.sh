#!/usr/bin/env bash
# Install the extras of `fbs bench` into the given Python's environment (idempotent).
# Usage: scripts/install_bench_deps.sh [PYTHON]   (default: python3; the Makefile passes the venv's python)
#
# - psutil: resident-set-size sampling and CPU facts recorded with every benchmark.
# - matplotlib: the PNG plot of decode latency vs layer-skip ratio (`fbs bench` skips the plot, with a
#   warning, when it is missing; tables and JSON need nothing beyond the core dependencies).
set -euo pipefail
PY="${1:-python3}"

has() { "$PY" -m pip show "$1" 2>/dev/null | grep -q "^Version: $2\$"; }

has psutil 7.2.2 || "$PY" -m pip install --quiet "psutil==7.2.2"
has matplotlib 3.11.2 || "$PY" -m pip install --quiet "matplotlib==3.11.2"
echo "bench deps ready"
