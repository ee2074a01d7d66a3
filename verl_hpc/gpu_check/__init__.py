"""The first-GPU check: one command that runs, in one process on one GPU, every GPU path of this
project that a single GPU can exercise, and says plainly what it could not.

    python -m verl_hpc.gpu_check [--out DIR] [--memory-plan MODULE:FUNCTION] [--only NAME ...]
    python -m verl_hpc.gpu_check --dry-run         # list the checks; runs anywhere, exits 0
    make gpu-check                                 # the same, with the repository's Python

Needs: CUDA torch, the project's source, and the wheels of `python -m verl_hpc.gpu_check.wheels`
installed offline (`pip install --no-index --find-links WHEELS -r WHEELS/requirements.txt`). No
network: the test model is made on the spot (verl_hpc.models.tiny).

Prints a table: PASS / FAIL / NOT TESTABLE (with why) per check, and the peak GPU memory of each
component (`torch.cuda.max_memory_allocated` around it). Exit code 1 when any check failed.
The checks are listed in `checks.CHECKS`; the memory-plan comparison is pluggable (memplan.py).
"""
