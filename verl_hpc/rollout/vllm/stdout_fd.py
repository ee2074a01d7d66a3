"""vLLM 0.25 builds its process groups under `suppress_stdout()`, which reads `sys.stdout.fileno()`:
in a process whose sys.stdout is not a file (an io.StringIO that captures a job's output, a notebook,
a logging wrapper) every engine construction fails with `io.UnsupportedOperation: fileno`, before
vLLM has built anything. Handler 8 of rollout/vllm/compat.py (0.25 only: rollout/vllm/versions.py).

The cause, in vLLM 0.25.0: `vllm.utils.system_utils.suppress_stdout` silences C libraries (gloo's
group creation prints) by pointing file descriptor 1 at /dev/null for the block; it finds that
descriptor through sys.stdout. vLLM 0.32 takes descriptor 1 itself, whatever sys.stdout is bound to
("C libraries write to fd 1"). The fix is 0.32's: the same context manager on descriptor 1, put
where 0.25's callers look it up (`vllm.distributed.parallel_state` and `vllm.distributed.utils`,
which import it by name). tests/unit/rollout/test_rol_vllm_compat.py pins the cause and checks an
engine's groups build with sys.stdout a StringIO.
"""
from __future__ import annotations

import contextlib
import os
import sys

TARGET = "vllm.utils.system_utils:suppress_stdout (as parallel_state and distributed.utils import it)"
WHY = "vLLM 0.25 read sys.stdout.fileno() to build its groups: no engine in a process whose stdout is not a file"
USERS = ("vllm.distributed.parallel_state", "vllm.distributed.utils")


@contextlib.contextmanager
def suppress_stdout():
    """C libraries' output on descriptor 1 to /dev/null for the block (vLLM 0.32's version)."""
    from vllm import envs

    if envs.VLLM_LOGGING_LEVEL == "DEBUG":  # 0.25's own rule: debug shows everything
        yield
        return
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stdout.flush()
        os.dup2(devnull, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def install() -> bool:
    """Put `suppress_stdout` where 0.25's callers find it (idempotent). True when this call did."""
    import importlib

    done = False
    for name in USERS:
        module = importlib.import_module(name)
        if module.suppress_stdout is not suppress_stdout:
            module.suppress_stdout = suppress_stdout
            done = True
    return done
