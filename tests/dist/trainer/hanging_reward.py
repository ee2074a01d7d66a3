"""A custom reward function that never returns and ignores the signals it can (tests of
reward.timeout_s); it touches $HANG_MARKER when it starts hanging."""
import os
import signal
import time
from pathlib import Path


def hang_forever(data_source, solution_str, ground_truth, extra):
    Path(os.environ["HANG_MARKER"]).touch()
    try:  # block what a timeout based on signals would use (only possible on the main thread)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGINT})
    except (ValueError, OSError):
        pass
    while True:
        time.sleep(1)
