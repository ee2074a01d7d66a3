"""The HTTP side of the agent endpoint: 127.0.0.1 only, a bearer token per run, OpenAI error bodies.

    server = AgentServer(service, host="127.0.0.1", port=0)     # a thread of the rollout process
    server.base_url(session_key)   # http://127.0.0.1:PORT/agents/<key>/v1, an agent's OPENAI_BASE_URL

Routes (under each run's base URL, and GET /v1/models also at the root):
  GET /v1/models, POST /v1/chat/completions, POST /v1/completions.
The session key in the path tells which sample's run made a call; the token (OPENAI_API_KEY) is
the same for every run of the job and is made fresh at start-up, so other users of the node cannot
call the policy. Errors answer as OpenAI's API does: {"error": {"message", "type", "param", "code"}},
whatever went wrong (another method: 405; a request line the HTTP parser refuses: its own status),
with `x-should-retry: false` (the openai client would otherwise retry a 409, 429 or 5xx, and none of
them gets better by asking again). A body may come with Content-Length or chunked. A body past
MAX_BODY is read to its end and dropped before the 413 goes out (up to DRAIN_LIMIT): a server that
closes with the body unread makes the client's kernel answer with a reset, and the client sees a
broken pipe instead of the 413.

Why the standard library's ThreadingHTTPServer: no HTTP framework is a dependency of this project
(setup.py), the traffic is loopback-only from the job's own agents, and a thread per connection is
what the batcher wants (each waiting request is a blocked thread; the engine thread batches them).
HTTP/1.1 keep-alive is on, so the openai client's connection pool reuses its connections.
"""
from __future__ import annotations

import hmac
import json
import logging
import secrets
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, Optional

from verl_hpc.rollout.agents.batcher import EngineClosed, EngineRequestError
from verl_hpc.rollout.agents.chat import BadRequest

log = logging.getLogger(__name__)
ACCEPT_POLL_S = 0.1  # how soon a sandbox's port stops accepting once its run ended
MAX_BODY = 16 << 20  # bytes of one request: far past any prompt the engine's window takes
DRAIN_LIMIT = 256 << 20  # an over-long body up to this is read and dropped, so the client reads the 413
METHODS = ("GET", "POST")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "server_error"}


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a connection an agent left open does not hold the job at shutdown
    allow_reuse_address = True
    # connections waiting to be accepted: the default 5 refuses some of 64 agents connecting at once
    request_queue_size = 1024


class AgentServer:
    def __init__(self, service, sessions: Callable[[str], Optional[object]], *, host: str = "127.0.0.1",
                 port: int = 0, token: Optional[str] = None, idle_timeout_s: float = 600.0):
        """sessions(key) -> the Session of that key, or None. idle_timeout_s: a kept-alive connection
        with no request for this long is closed (agents' clients are often dropped without closing
        theirs, and each open connection holds a server thread)."""
        self.idle_timeout_s = float(idle_timeout_s)
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"the agent endpoint listens on the loopback interface only, not {host!r}")
        self.service, self.sessions = service, sessions
        self.token = token or f"sk-verl-{secrets.token_urlsafe(24)}"
        self.requests = 0
        self.errors: Dict[int, int] = {}
        self._httpd = _Server((host, port), self._handler())
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="agent-endpoint", daemon=True)
        self._thread.start()

    def base_url(self, key: str) -> str:
        return f"http://{self.host}:{self.port}/agents/{key}/v1"

    def serve_socket(self, sock: socket.socket) -> Callable[[], None]:
        """Serve this endpoint also on `sock`, a listening socket made elsewhere (a command-line
        agent's sandbox: its own loopback port, verl_hpc/rollout/tools/sandbox_listener.py), with
        the same handler and token. Returns what stops accepting on it and closes it."""
        stop = threading.Event()

        def accept_loop():
            sock.settimeout(ACCEPT_POLL_S)  # a closed socket would not wake a blocked accept()
            try:
                while not stop.is_set():
                    try:
                        conn, addr = sock.accept()
                    except socket.timeout:
                        continue
                    except OSError:
                        return
                    conn.settimeout(None)
                    self._httpd.process_request(conn, addr)  # a thread per connection, as on the TCP port
            finally:
                sock.close()

        thread = threading.Thread(target=accept_loop, name="agent-endpoint-sandbox", daemon=True)
        thread.start()

        def close():
            stop.set()
            thread.join(timeout=5)

        return close

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the handler
    def _handler(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = outer.idle_timeout_s  # socket reads only: a request's generation time is not bounded by it

            def log_message(self, fmt, *args):  # the job's log is not an access log
                pass

            def do_GET(self):
                outer._dispatch(self, "GET")

            def do_POST(self):
                outer._dispatch(self, "POST")

            def do_PUT(self):  # and the other methods a client may send: 405, its body read first
                outer._dispatch(self, self.command)

            do_DELETE = do_PATCH = do_OPTIONS = do_PUT

            def send_error(self, code, message=None, explain=None):
                """What the HTTP parser refuses (a bad request line, an unknown method: 501 -> 405),
                as an OpenAI error body rather than the standard library's HTML page."""
                code = 405 if code == 501 else code
                text = message or self.responses.get(code, ("error",))[0]
                if code == 405:
                    text = f"method {getattr(self, 'command', '')} is not served; use {' or '.join(METHODS)}"
                self.close_connection = True  # the request was not understood: its body neither
                outer._respond(self, code, error_body(code, text), head=getattr(self, "command", "") == "HEAD")

        return Handler

    def _dispatch(self, h: BaseHTTPRequestHandler, method: str) -> None:
        self.requests += 1
        try:
            status, body = 200, self._route(h, method)
        except BadRequest as e:
            status, body = e.status, error_body(e.status, str(e), e.param, e.code)
        except EngineClosed as e:
            status, body = 503, error_body(503, str(e))
        except EngineRequestError as e:
            status = 400 if e.refused else 500
            body = error_body(status, str(e), code="engine_error")
        except Exception as e:  # noqa: BLE001 - the agent gets a 500; the job's log says what it was
            log.exception("agent endpoint: %s %s failed", method, h.path)
            status, body = 500, error_body(500, f"internal error: {type(e).__name__}: {e}")
        self._respond(h, status, body)

    def _respond(self, h: BaseHTTPRequestHandler, status: int, body: dict, head: bool = False) -> None:
        if status != 200:
            self.errors[status] = self.errors.get(status, 0) + 1
        data = json.dumps(body).encode()
        try:
            h.send_response(status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            if status != 200:
                h.send_header("x-should-retry", "false")
            if status == 405:
                h.send_header("Allow", ", ".join(METHODS))
            if h.close_connection:
                h.send_header("Connection", "close")
            h.end_headers()
            if not head:
                h.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the agent gave up (its own timeout)
            pass

    def _route(self, h: BaseHTTPRequestHandler, method: str) -> dict:
        body = self._read(h)  # read first, whatever the method: keep-alive needs the body consumed
        if method not in METHODS:
            raise BadRequest(f"method {method} is not served; use {' or '.join(METHODS)}", status=405,
                             code="method_not_allowed")
        scheme, _, token = h.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.token.encode()):
            raise BadRequest("invalid or missing API key (the OPENAI_API_KEY given to the agent run)",
                             status=401, code="invalid_api_key")
        path = h.path.split("?", 1)[0].rstrip("/")
        session, rest = None, path
        if path.startswith("/agents/"):
            key, _, tail = path[len("/agents/"):].partition("/")
            session = self.sessions(key)
            if session is None:
                raise BadRequest(f"no agent run {key!r} on this endpoint", status=404, code="unknown_run")
            rest = "/" + tail
        if rest == "/v1/models":
            if method != "GET":
                raise BadRequest("use GET for /v1/models", status=405)
            return self.service.models()
        if rest in ("/v1/chat/completions", "/v1/completions"):
            if method != "POST":
                raise BadRequest(f"use POST for {rest}", status=405)
            if session is None:
                raise BadRequest(f"{rest}: call it under the base URL your run was given (OPENAI_BASE_URL, "
                                 "/agents/<run>/v1): each call is recorded for its run", status=404)
            serve = self.service.chat_completion if rest.endswith("chat/completions") else self.service.completion
            return serve(session, body)
        raise BadRequest(f"no route {method} {path}; served: GET /v1/models, POST /v1/chat/completions, "
                         "POST /v1/completions", status=404)

    @staticmethod
    def _read(h: BaseHTTPRequestHandler):
        """The request's JSON body (None without one), sent with Content-Length or chunked."""
        chunked = "chunked" in h.headers.get("Transfer-Encoding", "").lower()
        try:
            length = int(h.headers.get("Content-Length") or 0)
            if length < 0:
                raise ValueError(length)
        except ValueError:
            h.close_connection = True  # where its body ends is unknown
            raise BadRequest("Content-Length is not a non-negative number") from None
        raw = _read_chunked(h) if chunked else _read_length(h, length)
        if raw is None:
            raise BadRequest(f"request body of more than {MAX_BODY} bytes", status=413, code="body_too_large")
        if not raw:
            return None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not JSON: {e}") from None


def _read_length(h: BaseHTTPRequestHandler, length: int) -> Optional[bytes]:
    """`length` bytes of body; None past MAX_BODY, the body read and dropped (up to DRAIN_LIMIT,
    past which the connection is closed instead)."""
    if length <= MAX_BODY:
        return h.rfile.read(length) if length > 0 else b""
    if length > DRAIN_LIMIT:
        h.close_connection = True
        return None
    while length > 0:
        got = h.rfile.read(min(length, 1 << 20))
        if not got:
            break
        length -= len(got)
    return None


def _read_chunked(h: BaseHTTPRequestHandler) -> Optional[bytes]:
    """A chunked body (RFC 9112 7.1): size lines in hex, each chunk, a 0 chunk, trailers. None past
    MAX_BODY (read to its end up to DRAIN_LIMIT, dropped)."""
    parts, total = [], 0
    while True:
        line = h.rfile.readline(1024)
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            h.close_connection = True
            raise BadRequest("a chunk of the chunked body has no size line") from None
        if size == 0:
            while h.rfile.readline(1024).strip():  # trailers, up to the empty line
                pass
            break
        total += size
        if total > DRAIN_LIMIT:
            h.close_connection = True
            return None
        data = h.rfile.read(size)
        h.rfile.readline(8)  # the chunk's CRLF
        if total <= MAX_BODY:
            parts.append(data)
    return b"".join(parts) if total <= MAX_BODY else None
