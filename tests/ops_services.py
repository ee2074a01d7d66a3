"""Real local services for the operations tests: a Pushgateway (the Debian `prometheus-pushgateway`,
installed by slurm/devcluster/start.sh, which `make test` runs) and an HTTP receiver for the alert
webhook, both on 127.0.0.1 on a free port, both gone when the `with` block ends."""
import contextlib
import json
import shutil
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

from prometheus_client.parser import text_string_to_metric_families

from verl_hpc.runtime.local_ranks import free_port

PUSHGATEWAY = "prometheus-pushgateway"


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


@contextlib.contextmanager
def pushgateway(folder):
    """Start a Pushgateway; yields its URL. Fails (never skips) when the package is missing."""
    exe = shutil.which(PUSHGATEWAY) or shutil.which(PUSHGATEWAY, path="/usr/bin:/usr/sbin")
    assert exe, (f"{PUSHGATEWAY} is not installed: `bash slurm/devcluster/start.sh` (make test runs it) "
                 f"or `apt-get install -y {PUSHGATEWAY}`")
    proc, url = _start_pushgateway(exe, folder / "pushgateway.log")
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _start_pushgateway(exe: str, log_path, tries: int = 3):
    """(process, URL) of a ready gateway. Its port is found free here and bound by the gateway a
    moment later: when another process took it in between, the gateway exits at once, and the
    next try takes another port."""
    for attempt in range(tries):
        port = free_port()
        with open(log_path, "w") as log:
            # Debian's build persists to /var/lib/prometheus by default: this one keeps to memory
            proc = subprocess.Popen([exe, f"--web.listen-address=127.0.0.1:{port}", "--persistence.file="],
                                    stdout=log, stderr=log)
        url, deadline = f"http://127.0.0.1:{port}", time.time() + 60
        while True:
            try:
                get(url + "/-/ready")
                return proc, url
            except OSError:
                if proc.poll() is not None:
                    said = log_path.read_text()
                    assert "address already in use" in said and attempt + 1 < tries, said
                    break
                if time.time() >= deadline:
                    proc.kill()
                    raise AssertionError(f"the Pushgateway was not ready in 60 s:\n{log_path.read_text()}")
                time.sleep(0.2)


def groups(url: str) -> list:
    """The gateway's groups (grouping labels + metric families), from its JSON API."""
    return json.loads(get(url + "/api/v1/metrics"))["data"]


def families(url: str) -> dict:
    """Every series the gateway exposes to Prometheus, parsed from its /metrics text."""
    return {f.name: f for f in text_string_to_metric_families(get(url + "/metrics"))}


def samples(family, **labels) -> list:
    return [s for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())]


@contextlib.contextmanager
def webhook_receiver():
    """An HTTP server recording the JSON bodies POSTed to it; yields (url, [(content_type, body)])."""
    got = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.headers["Content-Type"], json.loads(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", got
    finally:
        server.shutdown()
        server.server_close()
