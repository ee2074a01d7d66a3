"""Local ranks end when their launcher is killed outright.

torch's elastic agent (the local launcher, `submit --local`) starts every rank in a session of its
own, so a SIGKILL of the launcher (the OOM killer, `kill -9`, a test's timeout) reaches none of
the ranks: they would run on, holding the cores, the ports and the GPU, until they finish. The
launcher exports its pid; each rank polls its parent, and when it has been re-parented (the
launcher is gone) it exits at once. No checkpoint: the launcher that would requeue it is gone,
and `latest` still names the last complete one. Under Slurm, srun and slurmstepd do this already.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

log = logging.getLogger(__name__)

LAUNCHER_PID = "VERL_HPC_LAUNCHER_PID"  # set by launcher/local.py for the ranks it starts
EXIT_CODE = 1


def watch_launcher(poll_s: float = 1.0) -> Optional[threading.Thread]:
    """Start the watch if a local launcher started this rank (a daemon thread; None otherwise)."""
    launcher = os.environ.get(LAUNCHER_PID)
    if not launcher or os.getppid() != int(launcher):
        return None  # not started by it directly (a plain `python`, srun, mpirun, torchrun)

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(poll_s)
        log.error("the local launcher (pid %s) is gone (killed?): this rank stops too", launcher)
        logging.shutdown()
        os._exit(EXIT_CODE)

    thread = threading.Thread(target=watch, name="verl_hpc-launcher-watch", daemon=True)
    thread.start()
    return thread
