# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest workers (pytest-xdist); each test file runs whole in one worker, so its module fixtures load once
JOBS ?= 2

.PHONY: demo lint test test-all venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned to the CPU build: accelerate would otherwise pull a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# Three answers one at a time with the shipped drafter, then what speculation did: plain and speculative decoding
# side by side at batch 1 on the 16 benchmark prompts (speedup, accepted length, rows equal to plain decoding).
demo: $(STAMP)
	$(BIN)/specformer generate --model default --max-new-tokens 64 --batch-size 1 \
	  --prompt "What is the capital of France?" \
	  --prompt "Write one sentence about why the sky is blue." \
	  --prompt "Give me three tips for writing clear Python code."
	$(BIN)/specformer bench --model default --batch-sizes 1 --max-new-tokens 64 --repeats 2 --out runs/demo-bench.json

lint: $(STAMP)
	$(BIN)/ruff check .

test: lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow" -q -n $(JOBS) --dist loadfile

test-all: lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile

clean:
	rm -rf $(VENV) .pytest_cache
