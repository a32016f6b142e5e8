# The README's commands. `make test` and `make run` create .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CPU_TORCH := torch==2.13.0
# Triton runs the CUDA kernels' tests on the CPU through its interpreter.
CPU_TRITON := triton==3.6.0
BUNDLED := models/noesis-tiny

.PHONY: setup test test-all lint run serve bench-cpu clean espeak-ng

setup: $(VENV)/.installed

# torch goes in first: the pinned CPU build where there is no NVIDIA driver, otherwise whatever
# torch the user already installed (or the default CUDA build).
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
		if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
		else $(PY) -m pip install -q $(CPU_TORCH) $(CPU_TRITON); fi; \
	fi
	$(PY) -m pip install -q -e ".[dev,voice]"
	$(PY) -m pip install -q --no-deps silero-vad==6.2.3
	@command -v espeak-ng >/dev/null 2>&1 || $(MAKE) --no-print-directory espeak-ng
	@touch $@

# Speech synthesis needs the espeak-ng program (GPL: it runs as a separate process).
espeak-ng:
	@if [ "$$(id -u)" = 0 ]; then apt-get install -y -q espeak-ng >/dev/null || \
		(apt-get update -q >/dev/null && apt-get install -y -q espeak-ng >/dev/null); \
	else sudo apt-get install -y -q espeak-ng; fi

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks scripts

# The unit tier in one pytest-xdist worker per core (each test runs one torch thread), at most
# four; the e2e tier's servers run one after another.
test: lint
	$(PY) -m pytest tests/unit -q -n auto --maxprocesses 4
	$(PY) -m pytest tests/e2e -q

test-all: setup
	$(PY) -m pytest tests -q -m "not gpu"

# One question that needs a tool: the bundled model reasons (analysis), calls the calculator, reads
# its real result and answers (final).
run: setup
	$(VENV)/bin/noesis chat --model $(BUNDLED) --temperature 0 "What is 17 times 23?"

serve: setup
	$(VENV)/bin/noesis serve --model $(BUNDLED)

bench-cpu: setup
	$(PY) benchmarks/cpu_decode.py

clean:
	rm -rf $(VENV) .cache .bench .pytest_cache .ruff_cache
