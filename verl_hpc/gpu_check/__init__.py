"""The first-GPU check: one command that runs, in one process on one GPU, every GPU path of this
project that a single GPU can exercise, and says plainly what it could not.

    python -m verl_hpc.gpu_check [--out DIR] [--only NAME ...] [--cpu-rehearsal]
    python -m verl_hpc.gpu_check --dry-run         # list the checks and what each needs; exits 0
    make gpu-check                                 # the same, with the repository's Python
    make gpu-all                                   # install + check + gpu tests + demo + benchmark (all.py)

Needs: CUDA torch, the project's source, and the wheels of `python -m verl_hpc.gpu_check.wheels`
installed offline (`pip install --no-index --find-links WHEELS -r WHEELS/requirements.txt`). No
network: the test model is made on the spot (verl_hpc.models.tiny).

Prints a table: PASS / FAIL / NOT TESTABLE (with why) per check, the versions that differ from the
verified ones (preflight.py), and the peak GPU memory of each component. Exit code 1 when any check
failed. The checks are listed in `checks.CHECKS` and run by `kit.run_checks`; the FSDP engine's
checks (fsdp_checks.py) import nothing of megatron, so a GPU image without megatron-core still runs
them (the Megatron checks then say NOT TESTABLE); the memory-plan check compares the planner with
the kit's own job (memplan.py); the two-GPU checks start two ranks (multi_gpu.py; the context-parallel
one, with Transformer Engine only, cp_check.py).
"""
