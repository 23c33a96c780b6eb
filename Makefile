# Two entry points, both self-installing into one virtual environment at .venv/:
#   make demo   runs the main job end to end on embedded defaults
#   make test   runs the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvpilot-installed

.PHONY: demo test install clean

install: $(STAMP)

# Reinstall only when the project's dependencies change; pip's cache makes a rebuilt venv cheap.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvpilot demo

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info kvpilot-demo kvpilot-train mlruns.db mlartifacts
