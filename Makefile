# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create ./.venv on first use (CPU torch pinned, so no CUDA wheels are pulled).
PY      ?= python3
VENV    ?= .venv
TORCH   ?= torch==2.13.0
BIN      = $(VENV)/bin

.PHONY: demo test bench venv clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/python examples/quickstart.py

test: venv
	$(BIN)/python -m pytest -q

bench: venv
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) bench/results
