# Everything a fresh machine needs: `make demo`, `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: env demo test soak bench lint clean

env: $(STAMP)

# The pinned CPU build of torch goes in first, so that the library's own range (torch>=2.3)
# is already satisfied and pip never reaches for a multi-gigabyte CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_gpt.py

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

# 200 kills at every pipeline point and at random, then 20 rounds of a second writer started
# beside a live or a killed one plus a writer of the other tier kind on the same location,
# 33 kills each through dcp.async_save, a DeepSpeed job (LazyCheckpointEngine) and
# Lightning's LazyCheckpointIO, 40 kills of a writer on S3 (SeaweedFS on loopback) plus
# one of the S3 server itself, and 50 kills of a chain with mixed cadences (the parallel
# file system every 3rd step), a third of them inside the emergency copy a close writes;
# then 25 kills of a whole 4-rank HSDP job on a 2-D mesh, every listed step restored
soak: $(STAMP)
	LAZYCKPT_SOAK_KILLS=200 $(PY) -m pytest -q -p no:cacheprovider tests/test_crash.py tests/test_layouts_soak.py

bench: $(STAMP)
	$(PY) bench/run.py

lint: $(STAMP)
	$(PY) -m ruff check lazyckpt tiers tests examples bench
	$(PY) -m mypy

clean:
	rm -rf $(VENV) runs
