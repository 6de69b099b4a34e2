#!/usr/bin/env bash
# Install the data extras of fbs (corpus dedup, Chinese segmentation, fortunes-zh text).
# Usage: scripts/install_data_deps.sh PYTHON     (e.g. .venv/bin/python)
# Idempotent: each step is skipped when its result is already there.
set -euo pipefail

PY="${1:-python3}"
PIP=("$PY" -m pip install --disable-pip-version-check -q)

has_module() { "$PY" -c "import $1" >/dev/null 2>&1; }

if ! has_module datasketch; then
  echo "install_data_deps: datasketch"
  "${PIP[@]}" "datasketch==2.0.0"
fi

if ! has_module pkuseg; then
  # pkuseg's setup.py imports numpy and Cython, so it cannot build in an isolated environment.
  echo "install_data_deps: pkuseg (build helpers first)"
  "${PIP[@]}" numpy "cython==3.3.1" "setuptools>=68" "wheel==0.48.0"
  "${PIP[@]}" --no-build-isolation "pkuseg==0.0.25"
fi

if [ ! -f /usr/share/games/fortunes/tang300 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "install_data_deps: Debian fortunes-zh"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q fortunes-zh >/dev/null 2>&1; then
      apt-get update -q >/dev/null 2>&1 || true
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q fortunes-zh >/dev/null 2>&1 \
        || echo "install_data_deps: warning: could not install fortunes-zh; build without it (--sources ...)" >&2
    fi
  else
    echo "install_data_deps: note: fortunes-zh not installed (needs root and apt-get); the fortunes_zh source" \
         "will be unavailable unless you run 'apt-get install fortunes-zh'" >&2
  fi
fi

"$PY" -c "import datasketch, pkuseg" && echo "install_data_deps: ok"
