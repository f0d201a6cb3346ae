# Two commands do everything on a fresh machine:
#   make demo   create .venv (Python 3.12), install, train the tiny demo hybrid end to end on CPU
#   make test   create/reuse .venv and run the test suite
PY := .venv/bin/python
WORKDIR ?= runs/demo

.PHONY: demo test lint venv
venv: .venv/.installed
.venv/.installed: pyproject.toml scripts/setup.sh
	scripts/setup.sh
	@touch $@

demo: venv
	$(PY) -m hybrid_jax.train --config configs/demo.py --config.train.workdir=$(WORKDIR)

test: venv
	$(PY) -m pytest -n 2 --dist loadscope -q tests

lint: venv
	$(PY) -m ruff check .
