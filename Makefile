# Two commands (README): `make run` sets up and runs the default model; `make test` sets up and
# runs the test suite. Everything installs into .venv.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PROMPT  ?= The sliding window ring keeps
# torch 2.13 CPU comes from the machine's local wheel; a GPU machine keeps the torch it has
TORCH   ?= torch==2.13.0

.PHONY: setup run serve test test-gpu mutation

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[serve,test]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/python -m v41.generate --prompt "$(PROMPT)" --max-tokens 32

# the trained toy (tools/train_toy.py); SERVE_MODEL=toy serves the random-weight preset
SERVE_MODEL ?= v41/assets/toy-trained
serve: setup
	$(BIN)/python -m v41.serve --model $(SERVE_MODEL) --served-model-name $(notdir $(SERVE_MODEL)) $(filter-out $(notdir $(SERVE_MODEL)),toy)

# one worker per core, whole files per worker (a file's tests share their compiles), the files
# in collection order: tests/conftest.py puts the longest first
test: setup $(VENV)/.eval-installed
	$(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

# mutation score of the request-state modules ([tool.mutmut] in pyproject.toml, docs/mutation.md)
mutation: setup
	$(BIN)/python -m pip install -q -e ".[mutation]"
	$(BIN)/mutmut run --max-children 2
	$(BIN)/mutmut results

# lm-eval for benchmarks/lm_eval_serve.py and tests/test_lm_eval.py (the `eval` extra, not a runtime dependency)
# lm-eval (tests/test_lm_eval.py, benchmarks/lm_eval_serve.py): an extra, installed once
$(VENV)/.eval-installed: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[eval]"
	touch $@

.PHONY: eval-setup
eval-setup: $(VENV)/.eval-installed
