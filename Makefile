# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create ./.venv on first use (CPU torch pinned, so no CUDA wheels are pulled; the
# simulated-GPU tests bind to nccl4py with cuda-bindings 12: the test and nccl-cu12 extras).
PY      ?= python3
VENV    ?= .venv
TORCH   ?= torch==2.13.0
BIN      = $(VENV)/bin
# Two pytest workers: most tests wait on ranks, timers and process starts, not on a core.
PYTEST_ARGS ?= -n 2

.PHONY: demo test test-slow test-cu13 bench venv clean gpu-test docs dist-check coverage mutations flake-hunt chaos

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,nccl-cu12]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/python examples/quickstart.py

test: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) -m "not slow"

# The whole programs, as a user runs them (the examples, some under torchrun; every
# complete script of the guides and the README; the benchmarks' smoke runs; the chaos
# soak): a few minutes more. CI (.ci/run) runs them too.
test-slow: venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) -m slow

# The simulated GPU's doubles are autospecs of the installed cuda-bindings and nccl4py:
# run its tests (and the NCCL and streams ones) under cuda-bindings 13 too, in a venv of
# their own (CPU torch, the nccl-cu13 extra). .ci/run runs both majors.
VENV13 ?= .venv-cu13
$(VENV13)/bin/.installed: pyproject.toml
	$(PY) -m venv $(VENV13)
	$(VENV13)/bin/pip install -q --upgrade pip
	$(VENV13)/bin/pip install -q "$(TORCH)"
	$(VENV13)/bin/pip install -q -e ".[test,nccl-cu13]"
	touch $@

test-cu13: $(VENV13)/bin/.installed
	$(VENV13)/bin/python -c "import sys, cuda.bindings as b; v = b.__version__; print('cuda-bindings', v); sys.exit(v[:3] != '13.')"
	$(VENV13)/bin/python -m pytest -q $(PYTEST_ARGS) tests/*/test_simgpu_*.py tests/nccl/test_nccl4py.py tests/streams tests/project/test_doctor.py

bench: venv
	$(BIN)/python -m bench

# The suite N times on a fresh clone of HEAD beside two CPU hogs; lists every test
# that failed at least once (tools/flake_hunt.py).
N ?= 5
flake-hunt: venv
	$(BIN)/python tools/flake_hunt.py --runs $(N) -- $(PYTEST_ARGS)

# Ranks run random op streams and train in step while they are killed, frozen and aborted,
# and replacements join and grow the group back (bench/chaos.py).
MINUTES ?= 10
chaos: venv
	$(BIN)/python -m bench.chaos --minutes $(MINUTES)

# The documentation (docs/), warnings as errors; and the sdist + wheel checked in a fresh venv.
$(BIN)/.docs-installed: pyproject.toml $(BIN)/.installed
	$(BIN)/pip install -q -e ".[test,nccl-cu12,docs,dist]"
	touch $@

docs: $(BIN)/.docs-installed
	$(BIN)/sphinx-build -q -W --keep-going -n -b html docs docs/_build/html

dist-check: $(BIN)/.docs-installed
	PY="$(PY)" BIN="$(BIN)" TORCH="$(TORCH)" bash .ci/dist-check

# Line coverage of the GPU path (asynccoll/_backends/nccl/, streams/) by the CPU suite,
# per file; fails below 90 %.
coverage: venv
	-$(BIN)/python -m pytest -q --cov=asynccoll/_backends/nccl --cov=streams --cov-report= \
		--cov-report=json:$(VENV)/coverage.json
	$(BIN)/python -m tests.support.covered $(VENV)/coverage.json 90

# Deliberate breakages of the NCCL/CUDA path, each run against a temporary copy (minutes).
mutations: venv
	$(BIN)/python -m tests.support.mutations

# The GPU run, on a CUDA machine (tools/gpu_run.py): the GPU tests, then the GPU bench, each
# phase time-boxed (7 minutes in all), the report written into GPU_OUT as it goes. It uses
# the Python it is given and installs nothing (NO_VENV=1, the default); without a CUDA GPU
# it says so in seconds. INSTALL=1 first makes GPU_VENV with GPU_TORCH and the test and
# GPU_EXTRA extras (network needed): make gpu-test INSTALL=1 GPU_EXTRA=nccl-cu12.
GPU_OUT   ?= bench/results/gpu
GPU_TORCH ?= torch
GPU_EXTRA ?= nccl-cu13
GPU_VENV  ?= .venv-gpu
NO_VENV   ?= 1
ifeq ($(INSTALL),1)
GPU_PY = $(GPU_VENV)/bin/python
else
GPU_PY = $(PY)
endif
gpu-test:
ifeq ($(INSTALL),1)
	$(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q --upgrade pip
	$(GPU_VENV)/bin/pip install -q "$(GPU_TORCH)"
	$(GPU_VENV)/bin/pip install -q -e ".[test,$(GPU_EXTRA)]"
endif
	$(GPU_PY) tools/gpu_run.py --out $(GPU_OUT)

clean:
	rm -rf $(VENV) $(VENV13) bench/results docs/_build dist
