# Developer entry points. Everything runs from the project's own virtualenv, .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test lint up

# Re-installs only when pyproject.toml changed since the last install.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

up: install
	$(BIN)/baton up --demo
