# Set-up and entry points. `make demo` and `make test` work from a fresh clone: they create
# .venv when it is missing and install the pinned dependencies first.
SHELL := /bin/bash
PYTHON ?= python3
# Where PyTorch publishes its CPU-only builds (requirements-torch.lock names it; `make lock` writes it).
TORCH_INDEX := https://download.pytorch.org/whl/cpu
# torch's version, from requirements.in; PyPI's build of it (the fallback below) depends on these.
TORCH_PIN := $(shell grep -E '^torch==' requirements.in)
TORCH_CUDA_PACKAGES := nvidia-|cuda-|triton==
# pip's global configuration on some machines caps torch below the pin (a machine image that carries
# older wheels); the lock files are exact, so the torch install applies no outside constraints.
TORCH_PIP = PIP_CONSTRAINT=/dev/null $(BIN)/pip install --quiet --no-cache-dir
VENV := .venv
BIN := $(VENV)/bin
# .venv/.installed holds the hash of what the environment was installed from (INSTALL_INPUTS'
# contents): make installs again only when that hash changes, never because a file is newer (a
# fresh clone's files all are). An environment whose stamp holds another hash depends on FORCE.
STAMP := $(VENV)/.installed
INSTALL_INPUTS := requirements.lock requirements-torch.lock pyproject.toml
INSTALL_HASH := $(firstword $(shell { sha256sum $(INSTALL_INPUTS) 2>/dev/null || shasum -a 256 $(INSTALL_INPUTS); } | { sha256sum 2>/dev/null || shasum -a 256; }))
INSTALLED_HASH := $(firstword $(shell cat $(STAMP) 2>/dev/null))
PROJECT := $(shell sed -n 's/^name = "\(.*\)"$$/\1/p' pyproject.toml | head -n 1)
# make install puts uv (pinned in requirements.lock) into .venv with pip, then installs the locks with
# it: parallel downloads and unpacking, bytecode compiled on both cores (measured: benchmarks/README.md,
# "Install"). Its cache is the project's .cache/uv (below), hardlinked into the environments.
UV_PIN := $(shell grep -E '^uv==' requirements.lock)
UV_PIP = $(BIN)/uv pip install --quiet --python $(BIN)/python

# Prefect state stays inside the project; no telemetry from a machine without internet.
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
# A local flow run starts a temporary Prefect server; on a busy 2-core machine it needs more than 20 s.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120

.PHONY: FORCE help install data demo test test-fast lint figures serve serve-model lock params-doc side-envs bench-env lock-side-envs mlflow-ui clean clean-all

help:
	@echo "make install    create .venv and install the pinned dependencies (make demo and make test do it first)"
	@echo "make data       draw the demo datasets into data/demo/ (make demo and make test do it first)"
	@echo "make demo       set up, then run the whole pipeline offline on the built-in tiny model"
	@echo "make test-fast  the quick tier, under a minute: no server, launcher or side environment (run it before every commit)"
	@echo "make test       set up, then run the whole test suite (what .ci/run calls)"
	@echo "make lint       ruff over the tree, with the rules in pyproject.toml (CI runs it)"
	@echo "make serve      Prefect server + worker on 127.0.0.1:\$${PREFECT_PORT:-4200}, deployments finetune/main and finetune/nightly"
	@echo "make serve-model  a registered version over HTTP on 127.0.0.1:\$${PORT:-5001} (MODEL=models:/<name>@champion; the name: python -m tasks.register.naming)"
	@echo "make mlflow-ui  MLflow UI on 127.0.0.1:5000 over ./mlflow.db"
	@echo "make lock       re-resolve requirements.in into requirements.lock and requirements-torch.lock"
	@echo "make params-doc regenerate docs/parameters.md (every params.yaml key) from the stage configs"
	@echo "make side-envs  build .venv-xla (torch_xla) and .venv-ipex (Intel Extension for PyTorch) for their tests"
	@echo "make figures    measure the README's figures in fresh clones and rewrite its table (ROWS=\"install demo\": some)"
	@echo "make bench-env  build .venv-bench (torchvision, for diffusers' example scripts in benchmarks/)"
	@echo "make clean      delete the pipeline's outputs (models/, data/processed, data/class_images, data/demo/subject, reports/); keeps the MLflow store"
	@echo "make clean-all  the same and the MLflow store (mlflow.db, mlruns/, mlartifacts/: runs and registered models); or make clean MLFLOW=1"

# The Python that pyproject.toml's requires-python allows (tests/test_install.py keeps them in step).
PYTHON_NEEDED := 3.11
# Stops at once when $(1) is not Python $(PYTHON_NEEDED), saying how to get it.
define check_python
@v=$$($(1) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); \
if [ "$$v" != "$(PYTHON_NEEDED)" ]; then \
  echo "error: this project needs Python $(PYTHON_NEEDED) (pyproject.toml requires-python); $(1) is $${v:-not a working Python}."; \
  echo "  Get it: Debian 12: sudo apt-get install python3.11 python3.11-venv; elsewhere: uv python install 3.11 (or pyenv install 3.11)."; \
  echo "  Then: $(2)make $(or $(MAKECMDGOALS),install) PYTHON=python3.11 (or PYTHON=\$$(uv python find 3.11))"; \
  exit 1; fi
endef

# Stops (in a recipe's shell) when $(VENV)'s editable install of this project points at another
# checkout that still exists: installing would re-point it here, and that checkout would then run
# this one's code. Two checkouts, two environments.
define check_venv_owner
owner=$$($(BIN)/python -c 'import importlib.metadata as m, json, os, urllib.parse as u; \
  ds = [d for d in m.distributions() if (d.metadata["Name"] or "").lower().replace("_", "-") == "$(PROJECT)"]; \
  t = ds[0].read_text("direct_url.json") if ds else None; j = json.loads(t) if t else {}; \
  print(os.path.realpath(u.unquote(u.urlparse(j["url"]).path)) if j.get("dir_info", {}).get("editable") else "")'); \
if [ -n "$$owner" ] && [ "$$owner" != "$$(pwd -P)" ] && [ -d "$$owner" ]; then \
  echo "error: $(VENV) is the environment of another checkout: its editable install of $(PROJECT) points at $$owner;"; \
  echo "  installing here would re-point it at $$(pwd -P), and $$owner would then run this checkout's code."; \
  echo "  Give this checkout its own: unlink $(VENV) if it is a link to that one (rm -rf $(VENV) if it is a copy), then make $(or $(MAKECMDGOALS),install)."; \
  exit 1; fi
endef

$(BIN)/python:
	$(call check_python,$(PYTHON),)
	$(PYTHON) -m venv $(VENV)

# torch comes from requirements-torch.lock, which names PyTorch's CPU index. A wheel that pip's own
# configuration already provides (find-links: a wheelhouse, an offline mirror) is taken without
# asking any index (--no-index); otherwise pip downloads it from that index, and where that index
# cannot be reached, PyPI's build of the same version.
$(STAMP): $(BIN)/python $(if $(filter $(INSTALL_HASH),$(INSTALLED_HASH)),,FORCE)
	$(call check_python,$(BIN)/python,rm -rf $(VENV) && )
	@if [ -f $@ ] && [ ! -s $@ ] && [ -z "$$(find $(INSTALL_INPUTS) -newer $@ 2>/dev/null)" ]; then \
	  echo $(INSTALL_HASH) > $@.tmp && touch -r $@ $@.tmp && mv $@.tmp $@; \
	  echo "$(VENV) is up to date with $(INSTALL_INPUTS); its stamp now holds their hash"; exit 0; fi; \
	$(call check_venv_owner); \
	echo "installing pinned dependencies into $(VENV) (about 2.4 GB, and CUDA libraries where PyPI's torch is the one reachable)"; \
	start=$$(date +%s); \
	$(BIN)/pip install --quiet --no-cache-dir --no-deps $(UV_PIN) && \
	$(UV_PIP) --compile-bytecode --no-deps -r requirements.lock && \
	{ $(TORCH_PIP) --no-deps --no-index -r requirements-torch.lock 2>/dev/null || \
	  $(UV_PIP) --compile-bytecode --no-deps -r requirements-torch.lock 2>/dev/null || \
	  { echo "warning: PyTorch's CPU index is out of reach; installing PyPI's build of $(TORCH_PIN) (it carries CUDA libraries, about 3 GB more, and runs on CPU the same)"; \
	    $(UV_PIP) --compile-bytecode $(TORCH_PIN); }; } && \
	$(UV_PIP) --no-deps -e . && \
	if $(BIN)/python -c "import torchvision" 2>/dev/null; then \
	  echo "error: torchvision is installed in $(VENV); it breaks transformers' imports with torch's CPU build (pip uninstall torchvision)"; exit 1; fi && \
	echo "install took $$(( $$(date +%s) - start )) s" && \
	echo $(INSTALL_HASH) > $@

install: $(STAMP)

FORCE:

# Side environments for the back ends that need another torch than the project's: torch_xla
# 2.9 runs only with torch 2.9, intel_extension_for_pytorch 2.8 only with torch 2.8. Each gets
# requirements.lock (which holds no torch), then requirements-<name>.lock (the torch pair and what it adds
# or changes), all --no-deps, then the project (editable); torchao 0.18 leaves (it needs torch
# 2.10+, and peft imports it when present). torchvision stays out (it breaks
# transformers' imports here). Rebuilt only when a lock file changes (stamp .venv-<name>/.installed).
# uv (pinned in requirements.lock) installs them from one cache inside the project and hardlinks
# the files into each environment, so the CUDA packages both torch builds pull in (4.3 GB) and the
# rest of requirements.lock are stored once on disk, not once per environment.
SIDE_ENVS := xla ipex
export UV_CACHE_DIR ?= $(CURDIR)/.cache/uv
export UV_LINK_MODE ?= hardlink
# Free disk that building both side environments from an empty uv cache needs (measured
# 2026-11-21: 11.1 GB, all of it the cache; the environments are hardlinks into it), with a margin
# for the test run's own files. With less, `make test` leaves them out and says so (their tests
# then skip) instead of failing half-way through an install.
SIDE_ENVS_NEED_GB ?= 13

.venv-%/.installed: requirements-%.lock requirements.lock pyproject.toml $(STAMP)
	@echo "building .venv-$* from requirements.lock + requirements-$*.lock (torch with its CUDA packages, through uv's shared cache $(UV_CACHE_DIR))"
	@start=$$(date +%s); \
	rm -rf .venv-$* && $(BIN)/uv venv --quiet --python $(PYTHON) .venv-$* && \
	$(BIN)/uv pip install --quiet --python .venv-$*/bin/python --no-deps -r requirements.lock && \
	$(BIN)/uv pip install --quiet --python .venv-$*/bin/python --no-deps -r requirements-$*.lock && \
	$(BIN)/uv pip install --quiet --python .venv-$*/bin/python --no-deps -e . && \
	$(BIN)/uv pip uninstall --quiet --python .venv-$*/bin/python torchao && \
	if .venv-$*/bin/python -c "import torchvision" 2>/dev/null; then \
	  echo "error: torchvision is installed in .venv-$*; it breaks transformers (uv pip uninstall --python .venv-$*/bin/python torchvision)"; exit 1; fi && \
	echo ".venv-$* took $$(( $$(date +%s) - start )) s"
	@touch $@

side-envs: $(SIDE_ENVS:%=.venv-%/.installed)

# The benchmarks' environment (benchmarks/sd35/README.md): the project's pins plus torch's PyPI build and
# torchvision, so diffusers' own example scripts run beside our stages under the same torch version.
# Not used by the tests; torchvision stays out of .venv.
.venv-bench/.installed: requirements-bench.lock requirements.lock pyproject.toml $(STAMP)
	@start=$$(date +%s); \
	rm -rf .venv-bench && $(BIN)/uv venv --quiet --python $(PYTHON) .venv-bench && \
	$(BIN)/uv pip install --quiet --python .venv-bench/bin/python --no-deps -r requirements.lock -r requirements-bench.lock && \
	$(BIN)/uv pip install --quiet --python .venv-bench/bin/python --no-deps -e . && \
	echo ".venv-bench took $$(( $$(date +%s) - start )) s"
	@touch $@

bench-env: .venv-bench/.installed

# Re-resolve a side lock: the pair with its own dependencies on top of requirements.lock; the
# lines that differ from it become requirements-<name>.lock.
SIDE_PAIR_xla := torch==2.9.0 torch_xla==2.9.0
SIDE_PAIR_ipex := torch==2.8.0 intel_extension_for_pytorch==2.8.0
lock-side-envs: $(SIDE_ENVS:%=lock-side-env-%)

lock-side-env-%:
	rm -rf .venv-lock-$* && $(PYTHON) -m venv .venv-lock-$*
	.venv-lock-$*/bin/pip install --quiet --no-deps -r requirements.lock
	.venv-lock-$*/bin/pip freeze --all | LC_ALL=C sort > .venv-lock-$*/before
	.venv-lock-$*/bin/pip install --quiet $(SIDE_PAIR_$*)
	{ echo "# .venv-$*: installed with --no-deps after requirements.lock without torch (make side-envs)."; \
	  echo "# Generated by 'make lock-side-envs': what $(SIDE_PAIR_$*) add to or change in requirements.lock."; \
	  .venv-lock-$*/bin/pip freeze --all | LC_ALL=C sort | LC_ALL=C comm -13 .venv-lock-$*/before - \
	    | grep -v -E '^(-e |sd-finetune|pip==)'; } > requirements-$*.lock
	rm -rf .venv-lock-$*

data: $(STAMP)
	$(BIN)/python data/demo/generate.py --out data/demo/subject
	$(BIN)/python data/demo/concepts.py --out data/demo/concepts
	$(BIN)/python data/demo/edits.py --out data/demo/edits
	$(BIN)/python data/demo/clips.py --out data/demo/clips

demo: data
	@start=$$(date +%s); \
	$(BIN)/python -m flows.finetune && \
	echo "pipeline took $$(( $$(date +%s) - start )) s" && \
	$(BIN)/python -m flows.summary

# One torch thread per test process: the tiny models are overhead-bound, tests run beside
# servers and stage subprocesses on 2 cores, and seeded weights then match across machines.
test test-fast: export OMP_NUM_THREADS ?= 1

# make test runs its files in TEST_WORKERS processes (pytest-xdist), each file whole in one of them
# (--dist loadfile: a module's shared set-up is built once), in the order tests/conftest.py gives them
# (the longest files first, by tests/durations.json); --no-loadscope-reorder keeps that order, which
# xdist otherwise replaces by "most tests first" (it sent the one-test, five-minute modules last). Most tests wait on a subprocess, a server
# or a single-threaded tiny model: with two workers a 2-core machine was busy 73% of the run (61 CPU
# minutes in 42), so three share the two cores; TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 3
# The quick tier in two (one per core): its tests are CPU-bound, a second worker cut it by a fifth.
FAST_WORKERS ?= 2

# The side environments are built first, so that tests/train/test_side_envs.py runs the XLA and
# IPEX back ends instead of skipping; on a disk with less than SIDE_ENVS_NEED_GB free they are
# left out with a warning (a failed install still fails the run).
test: data
	@if $(MAKE) --no-print-directory -q side-envs 2>/dev/null; then :; \
	else free=$$(df --output=avail -BG . | tail -1 | tr -dc 0-9); \
	  if [ "$$free" -lt "$(SIDE_ENVS_NEED_GB)" ]; then \
	    echo "warning: not building .venv-xla and .venv-ipex: $${free} GB free here, they need about $(SIDE_ENVS_NEED_GB) GB; tests/train/test_side_envs.py will skip (free disk, then make side-envs)"; \
	  else $(MAKE) --no-print-directory side-envs || exit 1; fi; \
	fi
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The quick tier (modules marked `pytestmark = pytest.mark.quick`): what needs no server, launcher,
# side environment or minutes of model work, the tier to run before every commit; make test runs it too.
test-fast: data
	$(BIN)/python -m pytest -m quick -n $(FAST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# ruff with the rules in pyproject.toml, over the whole tree (CI runs it before the tests).
lint: $(STAMP)
	$(BIN)/ruff check .

serve: $(STAMP)
	$(BIN)/python -m flows.serve

# The README's table of figures (install, demo, test-fast, test, CI), measured in fresh clones
# (benchmarks/figures.py); ROWS picks some, e.g. make figures ROWS="install demo test-fast".
figures: $(STAMP)
	$(BIN)/python -m benchmarks.figures $(ROWS)

# A registered version over HTTP (docs/registry.md, "The registry"): MODEL (a models:/ URI), PORT, SERVE_ARGS
# (more `mlflow models serve` options, e.g. --timeout 120 --workers 2). This environment's bin goes
# on PATH: mlflow starts its scoring server by execing `uvicorn` by name. MLflow's CLI runs through
# tasks.register.verified: the version's files are checked against its registered manifest first, and
# a request body over FINETUNE_SERVE_MAX_BODY_BYTES (65 MiB) is answered 413 (tasks/register/serve_app.py).
# MODEL unset: the champion of the model this workspace registers under (register.model_name, or the
# name that follows what was trained: sd-dreambooth for the demo; tasks/register/naming.py).
MODEL ?=
PORT ?= 5001
serve-model: $(STAMP)
	@model="$(MODEL)"; [ -n "$$model" ] || model="models:/$$($(BIN)/python -m tasks.register.naming)@champion" || exit 1; \
	PATH="$(CURDIR)/$(BIN):$$PATH" MLFLOW_TRACKING_URI="$${MLFLOW_TRACKING_URI:-sqlite:///$(CURDIR)/mlflow.db}" \
	  $(BIN)/python -m tasks.register.verified models serve -m "$$model" --env-manager local -h 127.0.0.1 -p $(PORT) $(SERVE_ARGS)

mlflow-ui: $(STAMP)
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port $${MLFLOW_PORT:-5000}

lock:
	$(call check_python,$(PYTHON),)
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	PIP_CONSTRAINT=/dev/null .venv-lock/bin/pip install --quiet --index-url $(TORCH_INDEX) $(TORCH_PIN) || \
	  PIP_CONSTRAINT=/dev/null .venv-lock/bin/pip install --quiet $(TORCH_PIN)
	PIP_CONSTRAINT=/dev/null .venv-lock/bin/pip install --quiet -r requirements.in
	PIP_CONSTRAINT=/dev/null .venv-lock/bin/pip install --quiet --no-deps optimum-intel==2.2.0
	{ echo "# Every package, pinned: generated by 'make lock' from requirements.in; installed with --no-deps."; \
	  echo "# optimum-intel's declared torchvision is deliberately absent (see requirements.in). torch is in"; \
	  echo "# requirements-torch.lock: its CPU build comes from PyTorch's own index."; \
	  .venv-lock/bin/pip freeze --all | grep -v -E '^(-e |sd-finetune|pip==|torch==|$(TORCH_CUDA_PACKAGES))'; } > requirements.lock
	{ echo "# torch's CPU build: PyTorch publishes it on its own index, not on PyPI (which has only the"; \
	  echo "# CUDA build). Generated by 'make lock'; installed with --no-deps after requirements.lock."; \
	  echo "--index-url $(TORCH_INDEX)"; \
	  echo "$(TORCH_PIN)+cpu"; } > requirements-torch.lock
	rm -rf .venv-lock

# docs/parameters.md from the typed stage configs (tests/flows/test_params_doc.py fails while it is stale).
params-doc: $(STAMP)
	$(BIN)/python -m flows.params_doc --write

# The pipeline's outputs: DVC brings them back (dvc checkout, or dvc repro). The MLflow store holds
# the record (runs, registered models, aliases) that nothing rebuilds: removed only when asked.
OUTPUTS := models data/processed data/class_images data/demo/subject reports
MLFLOW_STORE := mlflow.db mlruns mlartifacts
clean:
	rm -rf $(OUTPUTS) $(if $(filter 1 yes true,$(MLFLOW)),$(MLFLOW_STORE))
	@$(if $(filter 1 yes true,$(MLFLOW)),:,echo "kept the MLflow store ($(MLFLOW_STORE)): make clean-all removes it too")

clean-all:
	$(MAKE) clean MLFLOW=1
