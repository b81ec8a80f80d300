# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= runs/demo_$(MODEL)
MODEL ?= t5_1_1
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
TEST_WORKERS ?= 2  # pytest-xdist processes (CI has 2 cores); files stay whole so module fixtures run once

.PHONY: demo compare-demo test test-integration test-all fmt fmt-check install wheel-check clean-venv gpu-compile-env test-gpu-compile docs

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel

# Reinstall only when setup.py changes; the package itself is installed editable. A run needs the package alone
# (RUN_STAMP); the suite also its test extra (pytest, libtpu for the TPU compile tests).
$(RUN_STAMP): setup.py | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $(RUN_STAMP)

$(STAMP): setup.py | $(PY)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP) $(RUN_STAMP)

install: $(STAMP)

demo: $(RUN_STAMP)
	$(VENV)/bin/remixer-t5 train --gin_file=models/$(MODEL)/tiny.gin --gin_file=runs/demo.gin \
	    --gin.MODEL_DIR="'$(MODEL_DIR)'"

# Train T5.1.1, Remixer and HyperMixer tiny on the same budget (embedded corpus, runs/demo.gin with fewer steps
# and a smaller batch), then put them side by side: $(COMPARE_DIR)/compare.png, compare.md, compare.csv.
# A rerun resumes (or skips) the runs; a new budget needs a new COMPARE_DIR.
COMPARE_DIR ?= runs/compare_demo
COMPARE_MODELS ?= t5_1_1 remixer hypermixer
COMPARE_STEPS ?= 100
COMPARE_BATCH ?= 16
compare-demo: $(RUN_STAMP)
	@mkdir -p $(COMPARE_DIR); for m in $(COMPARE_MODELS); do \
	  echo "== training $$m tiny for $(COMPARE_STEPS) steps of $(COMPARE_BATCH) into $(COMPARE_DIR)/$$m"; \
	  $(VENV)/bin/remixer-t5 train --gin_file=models/$$m/tiny.gin --gin_file=runs/demo.gin \
	      --gin.MODEL_DIR="'$(COMPARE_DIR)/$$m'" --gin.TRAIN_STEPS=$(COMPARE_STEPS) --gin.BATCH_SIZE=$(COMPARE_BATCH) \
	      --gin.LOG_PERIOD=10 --gin.EVAL_PERIOD=25 --gin.CHECKPOINT_PERIOD=$(COMPARE_STEPS) --gin.EVAL_STEPS=2 \
	      > $(COMPARE_DIR)/$$m.log 2>&1 \
	    || { tail -n 20 $(COMPARE_DIR)/$$m.log; exit 1; }; \
	  grep '^\[validation\]' $(COMPARE_DIR)/$$m.log | tail -n 1; \
	done
	$(VENV)/bin/remixer-t5 compare $(addprefix $(COMPARE_DIR)/,$(COMPARE_MODELS)) --out $(COMPARE_DIR)

# `make test` (what CI runs) leaves out the tests marked `integration` (tests/conftest.py: end-to-end runs through
# processes and scripts, and architecture sweeps whose one representative stays in `make test`); run them with
# `make test-integration`, or the whole suite with `make test-all`.
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
test: $(STAMP)
	$(PYTEST) -m "not integration" tests

test-integration: $(STAMP)
	$(PYTEST) -m integration tests

test-all: $(STAMP)
	$(PYTEST) tests

# The one formatter, configured in ruff.toml: `make fmt` formats the tree, `make fmt-check` (CI) fails on any
# file it would change.
fmt: $(STAMP)
	$(VENV)/bin/ruff format .

fmt-check: $(STAMP)
	$(VENV)/bin/ruff format --check .

# The manual (docs/, mkdocs.yml) as a site in $(DOCS_SITE); strict: a broken link, a missing page or anchor fails.
DOCS_SITE ?= site
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): setup.py | $(PY)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir $(DOCS_SITE)

# Build a wheel, install it into a fresh venv and run the CLI from outside the repository.
wheel-check: $(STAMP)
	bash scripts/wheel_check.sh $(PY)

clean-venv:
	rm -rf $(VENV)

# GPU programs compiled without a GPU (`remixer-t5 compile --topology h100x8`) need the CUDA compiler plugin
# (setup.py's gpu-compile extra), kept in its own venv: .venv-gpu sees everything in .venv (a site dir added by
# a .pth line) plus the plugin, so .venv's CPU runs never see CUDA. `make test` skips the GPU compile tests;
# this target runs them.
GPU_VENV ?= .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed
$(GPU_STAMP): setup.py $(STAMP)
	$(PYTHON) -m venv $(GPU_VENV)
	echo "import site; site.addsitedir('$(abspath $(VENV))/lib/python3.11/site-packages')" \
	    > $(GPU_VENV)/lib/python3.11/site-packages/remixer_t5_main_venv.pth
	$(GPU_VENV)/bin/python -m pip install --quiet -e '.[gpu-compile]'
	touch $(GPU_STAMP)

gpu-compile-env: $(GPU_STAMP)

test-gpu-compile: $(GPU_STAMP)
	JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python -m pytest -q tests/test_compile_gpu.py
