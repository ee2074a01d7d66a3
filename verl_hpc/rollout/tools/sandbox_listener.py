"""A sandbox run's own loopback port, served by the rank (Sandbox.run_command's `serve`).

The run's first process (sandbox_inner.listen) makes a socket listening on 127.0.0.1 inside the
run's network namespace and sends it here over a socket pair; the rank accepts the code's
connections on it. A socket belongs to the namespace it was made in, so this is a way into the
sandbox's network with no way out of it: the code reaches that one port and nothing else, and no
relay process runs inside. Command-line agents reach the agent endpoint this way
(verl_hpc/rollout/agents/command.py).
"""
from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple


@dataclass
class CommandJob:
    """What run_command adds to a run (see there)."""
    command: str
    env: Dict[str, str]
    files: Dict[str, str]
    read_only: Tuple[str, ...]
    serve: Optional[Callable[[socket.socket], Callable[[], None]]]
    url_env: str
    url: str


class Listener:
    """Receives the run's listening socket from sandbox_inner.listen (EOF if the run ended before)
    on a thread, so the run is supervised meanwhile, and hands it to `serve`."""

    def __init__(self, channel: socket.socket, serve):
        self.channel, self.serve, self._stop = channel, serve, None
        self._thread = threading.Thread(target=self._receive, name="sandbox-listener", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            _, fds, _, _ = socket.recv_fds(self.channel, 1, 1)
        except OSError:
            return
        if fds:
            self._stop = self.serve(socket.socket(fileno=fds[0]))

    def stop(self) -> None:
        """After the run: its end of the channel is closed by then, so the thread has returned."""
        self._thread.join(timeout=5)
        self.channel.close()
        if self._stop is not None:
            self._stop()
