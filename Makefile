PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch's CPU build (PyPI's default Linux build is a CUDA one of several GB): from the configured
# indexes and wheel folders if one has it, else from PyTorch's CPU index, else (that index out of
# reach) PyPI's build; a torch already in the virtual environment (a CUDA build installed by hand,
# say) is kept
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup lint test test-all golden docs serve clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
		$(PY) -m pip install --quiet --timeout 30 --retries 1 --index-url $(TORCH_CPU_INDEX) \
			"torch==$(TORCH_VERSION)+cpu" 2>/dev/null || $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the default suite, the tests marked slow (longer end-to-end runs) and more Hypothesis examples
test-all: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow" --hypothesis-profile thorough $(PYTEST_ARGS)

# HF transformers' reference outputs under tests/golden (see tests/golden/regenerate.py)
golden: $(STAMP)
	$(PY) tests/golden/regenerate.py $(GOLDEN)

# docs/configuration.md, from the parser of `hicache serve` (tests/server/test_reference.py checks it)
docs: $(STAMP)
	$(PY) -m hicache.server.reference > docs/configuration.md

serve: $(STAMP)
	$(VENV)/bin/hicache serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
