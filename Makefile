# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= runs/demo_$(MODEL)
MODEL ?= t5_1_1
STAMP := $(VENV)/.installed
TEST_WORKERS ?= 2  # pytest-xdist processes (CI has 2 cores); files stay whole so module fixtures run once

.PHONY: demo compare-demo test install wheel-check clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel

# Reinstall only when setup.py changes; the package itself is installed editable.
$(STAMP): setup.py | $(PY)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/remixer-t5 train --gin_file=models/$(MODEL)/tiny.gin --gin_file=runs/demo.gin \
	    --gin.MODEL_DIR="'$(MODEL_DIR)'"

# Train T5.1.1, Remixer and HyperMixer tiny on the same budget (embedded corpus, runs/demo.gin with fewer steps
# and a smaller batch), then put them side by side: $(COMPARE_DIR)/compare.png, compare.md, compare.csv.
# A rerun resumes (or skips) the runs; a new budget needs a new COMPARE_DIR.
COMPARE_DIR ?= runs/compare_demo
COMPARE_MODELS ?= t5_1_1 remixer hypermixer
COMPARE_STEPS ?= 100
COMPARE_BATCH ?= 16
compare-demo: $(STAMP)
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

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# Build a wheel, install it into a fresh venv and run the CLI from outside the repository.
wheel-check: $(STAMP)
	bash scripts/wheel_check.sh $(PY)

clean-venv:
	rm -rf $(VENV)
