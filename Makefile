# Two commands from a clean clone: `make demo` (the main training job) and `make test` (the suite).
# Each creates .venv on first use. TORCH picks the torch build: the CPU wheel of 2.13.0 by default
# (it lies on this machine's disk); a GPU user installs a CUDA build first, or runs e.g.
#   make TORCH="torch --index-url https://download.pytorch.org/whl/cu126" demo
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
HF_PACKAGES := .hf_packages
export OMP_NUM_THREADS ?= 1

.PHONY: demo test lint format experiments clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[dev]"
	# transformers and litgpt for the Hugging Face tests, in a folder of their own (.hf_packages) that
	# only those tests put on sys.path: installed in the venv, transformers is imported by torchmetrics
	# (so by Lightning) in every process, ~2 s more for each spawned rank of the suite. litgpt's model
	# code needs torch only; its pin of huggingface-hub<1.4 conflicts with transformers 5: no deps.
	rm -rf $(HF_PACKAGES)
	$(PY) -m pip install --quiet --target $(HF_PACKAGES) "transformers==5.23.0"
	$(PY) -m pip install --quiet --no-deps --target $(HF_PACKAGES) "litgpt==0.5.13"
	# peft (LoRA adapters) for the fine-tuning tests; it imports accelerate and psutil, whose own
	# dependencies (torch, numpy, ...) are there already: no deps, so pip never pulls another torch.
	$(PY) -m pip install --quiet --no-deps --target $(HF_PACKAGES) "peft==0.21.2" "accelerate==1.15.0" "psutil==7.2.2"
	# x-transformers (a decoder library outside transformers and litgpt, tests/third_party_models.py) and
	# its pure-Python dependencies; numpy and sympy come with torch's: no deps.
	$(PY) -m pip install --quiet --no-deps --target $(HF_PACKAGES) "x-transformers==2.31.10" "einops==0.8.2" \
		"einx==0.4.3" "loguru==0.7.3" "torch-einops-utils==0.2.0" "frozendict==2.5.1"
	touch $@

demo: $(VENV)/.installed
	$(PY) experiments/train_charlm.py

# The suite on TEST_WORKERS pytest-xdist workers, a file at a time (--dist loadfile: a module's spawned
# job is set up once), in the order conftest.py gives (the files with slow tests first).
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Every benchmark with its defaults (meant to stay under 25 minutes on 2 quiet cores, bench_compile's
# inductor builds included; docs/results.md states how long the last full run took), then the results
# block of docs/results.md rebuilt from experiments/results/.
experiments: $(VENV)/.installed
	$(PY) experiments/run_all.py

clean:
	rm -rf $(VENV) $(HF_PACKAGES) runs lightning_logs .pytest_cache .ruff_cache
