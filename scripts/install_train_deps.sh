#!/usr/bin/env bash
# Extras of `fbs train`. Everything Stage-1 needs (torch, accelerate, safetensors, tqdm, pyyaml) is a core
# dependency in pyproject.toml; TensorBoard logging is optional and used only when importable.
# Usage: scripts/install_train_deps.sh PYTHON     (e.g. .venv/bin/python). Idempotent.
set -euo pipefail

PY="${1:-python3}"

if [ "${FBS_TRAIN_TENSORBOARD:-0}" = "1" ] && ! "$PY" -c "import tensorboard" >/dev/null 2>&1; then
  echo "install_train_deps: tensorboard"
  "$PY" -m pip install --disable-pip-version-check -q "tensorboard==2.20.0"
fi

"$PY" -c "import accelerate, safetensors, tqdm, yaml" && echo "install_train_deps: ok"
