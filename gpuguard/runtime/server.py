"""/healthz, /readyz and /metrics on a small threaded HTTP server.

/healthz is liveness: 200 while the check loop has completed a check within the last 3 intervals, whatever
the GPUs say (a sick GPU must not make kubelet restart the agent). /readyz: 200 after the first complete
check and node reconcile.

The port is reachable by every pod in the cluster (kubelet probes the pod IP), so the server treats every
request as hostile and bounds what one can cost:
- only GET and HEAD, only on these three paths (405 with Allow for another method, 404 for another path);
- the request line at most MAX_REQUEST_LINE bytes with its line ending (414), at most MAX_HEADERS header
  lines and MAX_HEADER_BYTES bytes of them (431), no body (413, or 400 for Transfer-Encoding);
- the whole request head must arrive within REQUEST_TIMEOUT seconds, however slowly it trickles in
  (408), and one connection serves one request (HTTP/1.0, no keep-alive);
- at most MAX_CONNECTIONS connections at once; beyond that, 503 and close, so a flood cannot exhaust
  threads or memory (the pod has a 128 MiB limit).
Nothing from the request is echoed back.
"""

from __future__ import annotations

import io
import json
import re
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gpuguard.core.model import AgentStatus
from gpuguard.runtime.health import health_body

log = structlog.get_logger(__name__)

REQUEST_TIMEOUT = 5.0
"""Seconds for a client to send its whole request head; also the socket timeout for the response."""
MAX_REQUEST_LINE = 2048
MAX_HEADERS = 32
MAX_HEADER_BYTES = 8192
MAX_CONNECTIONS = 64
LINGER = 0.25
"""Seconds, at most, to drain what a client still sends after its answer (see finish())."""
MAX_LINGER_BYTES = 64 * 1024
PATHS = ("/healthz", "/readyz", "/metrics")
ALLOWED_METHODS = ("GET", "HEAD")
_RECV = 4096
_CONTENT_LENGTH = re.compile(r"[0-9]{1,19}")
_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class HealthServer:
    def __init__(
        self,
        status: Callable[[], AgentStatus],
        *,
        host: str,
        port: int,
        registry: CollectorRegistry | None = None,
    ) -> None:
        handler = _make_handler(status, registry)
        self._httpd = _BoundedServer((host, port), handler)
        self._httpd.timeout = 0.0
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def host(self) -> str:
        """The address bound (an empty --listen HOST: "::", every interface, IPv6 and IPv4, or "0.0.0.0")."""
        return str(self._httpd.server_address[0])

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="gpuguard-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            return  # stopped already
        if self._thread is not None:
            self._thread.join(2.0)
        self._httpd.server_close()
        self._wake_r.close()
        self._wake_w.close()

    def _serve(self) -> None:
        """Accept connections until stop(). Unlike serve_forever's 0.5 s poll, the thread sleeps until a
        connection or stop() arrives: an idle agent is woken by nothing but its own check interval."""
        with selectors.DefaultSelector() as sel:
            sel.register(self._httpd, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = sel.select()
                if any(key.fileobj is self._wake_r for key, _ in ready):
                    return
                self._httpd.handle_request()  # timeout 0: never blocks if the connection went away


class _BoundedServer(ThreadingHTTPServer):
    """One thread per connection, but never more than MAX_CONNECTIONS of them."""

    daemon_threads = True
    request_queue_size = 2 * MAX_CONNECTIONS  # connects beyond the slots wait to be told 503, not dropped

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        host, port = address
        self._dual_stack = not host
        if not host:
            # Every interface of both families: one IPv6 socket that also accepts IPv4 (mapped addresses),
            # so probes reach the pod on an IPv4, IPv6 or dual-stack cluster alike. IPv4 only on a host
            # without IPv6.
            host = "::" if socket.has_ipv6 and _ipv6_works() else "0.0.0.0"  # noqa: S104 - all interfaces
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), handler)

    def server_bind(self) -> None:
        if self._dual_stack and self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            # Refused on the accepting thread without reading anything: a few bytes into an empty send
            # buffer, with a timeout in case even that blocks.
            try:
                request.settimeout(0.5)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # the thread did not start: its slot is free
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver's default prints a traceback to stderr, outside the JSON logs. A handler error is
        # a bug (every refusal is an answer, not an exception): one structured line, and the server goes on.
        exc = sys.exc_info()[1]
        log.error("http.handler_error", error=f"{type(exc).__name__}: {exc}"[:300])


def _ipv6_works() -> bool:
    """Whether this host can open an IPv6 socket at all (IPv6 disabled in the kernel: it cannot)."""
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    except OSError:
        return False
    return True


class _Refused(Exception):
    """The request is refused with this HTTP status before it is parsed (or silently, with None)."""

    def __init__(self, status: int | None) -> None:
        super().__init__(status)
        self.status = status


def _make_handler(
    status: Callable[[], AgentStatus], registry: CollectorRegistry | None
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT  # the socket timeout for writing the response
        server_version = "gpuguard"
        sys_version = ""
        protocol_version = "HTTP/1.0"  # one request per connection: no keep-alive to hold a thread
        # What an error is answered as before the request's own version is known. The stdlib's default,
        # HTTP/0.9, would answer with a bare body and no status line.
        default_request_version = "HTTP/1.0"

        def handle(self) -> None:
            # One request, whatever the client asks for (close_connection stays True with HTTP/1.0).
            self.close_connection = True
            self.handle_one_request()

        def handle_one_request(self) -> None:
            self.requestline, self.request_version, self.command = "", self.default_request_version, ""
            try:
                line, headers = self._read_head()
            except _Refused as refused:
                if refused.status is not None:
                    self._error(refused.status, head_only=False)
                return
            self.raw_requestline = line
            # parse_request() reads the headers from rfile: give it exactly the bounded head, so it can
            # neither block nor read past our limits.
            socket_file, self.rfile = self.rfile, io.BytesIO(headers + b"\r\n")
            try:
                if not self.parse_request():
                    return  # it has answered 400 or 505 itself, or the request line was blank
            finally:
                self.rfile = socket_file
            if len(self.requestline.split()) != 3 or not self.request_version.startswith("HTTP/1."):
                # HTTP/0.9 ("GET /path" alone, or said outright) would be answered with a bare body.
                self.request_version = self.default_request_version
                self._error(400, head_only=False)
                return
            self._dispatch()

        def _read_head(self) -> tuple[bytes, bytes]:
            """(request line, header lines), read under the size limits and one overall deadline.

            Straight from the socket with the time left as its timeout: a buffered readline() would wait
            REQUEST_TIMEOUT per byte for a client that sends one byte at a time."""
            deadline = time.monotonic() + REQUEST_TIMEOUT
            buf = bytearray()
            while True:
                first = buf.find(b"\n")
                if (first + 1 if first >= 0 else len(buf)) > MAX_REQUEST_LINE:  # line ending included
                    raise _Refused(414)
                end = _end_of_head(buf)
                if end >= 0:
                    break
                if len(buf) > MAX_REQUEST_LINE + MAX_HEADER_BYTES:
                    raise _Refused(431)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Refused(408)
                self.connection.settimeout(left)
                try:
                    chunk = self.connection.recv(_RECV)
                except TimeoutError:
                    raise _Refused(408) from None
                except OSError:
                    raise _Refused(None) from None
                if not chunk:  # the client closed: nobody to answer
                    raise _Refused(None)
                buf += chunk
            self.connection.settimeout(REQUEST_TIMEOUT)
            line, headers = bytes(buf[: first + 1]), bytes(buf[first + 1 : end + 1])
            if headers.count(b"\n") > MAX_HEADERS or len(headers) > MAX_HEADER_BYTES:
                raise _Refused(431)
            return line, headers

        def finish(self) -> None:
            super().finish()
            # Lingering close: a refused request may leave bytes unread (a body, the rest of a huge
            # line), and closing over unread bytes sends a TCP reset that can destroy our answer before
            # the client reads it. Half-close, then drain briefly and boundedly, then close.
            try:
                self.connection.shutdown(socket.SHUT_WR)
                deadline = time.monotonic() + LINGER
                drained = 0
                while drained < MAX_LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
                    self.connection.settimeout(left)
                    chunk = self.connection.recv(_RECV)
                    if not chunk:
                        break
                    drained += len(chunk)
            except OSError:
                pass  # the client is gone already: nothing to protect

        def _dispatch(self) -> None:
            head_only = self.command == "HEAD"
            path = self.path.split("?", 1)[0]
            if path not in PATHS or (path == "/metrics" and registry is None):
                self._error(404, head_only)
            elif self.command not in ALLOWED_METHODS:
                self._error(405, head_only, allow=", ".join(ALLOWED_METHODS))
            elif (problem := self._body_problem()) is not None:
                self._error(problem, head_only)
            else:
                self._serve(path, head_only)

        def _body_problem(self) -> int | None:
            """GET and HEAD carry no body here; one that comes anyway is refused, never read."""
            if self.headers.get_all("Transfer-Encoding"):
                return 400
            lengths = self.headers.get_all("Content-Length") or []
            if not lengths:
                return None
            # [0-9] and not str.isdigit(), which also accepts "²", which int() refuses.
            if len(lengths) > 1 or not _CONTENT_LENGTH.fullmatch(lengths[0].strip()):
                return 400
            return 413 if int(lengths[0]) > 0 else None

        def _serve(self, path: str, head: bool) -> None:
            if path == "/healthz":
                s = status()
                body = json.dumps(health_body(s)).encode()
                self._send(200 if s.alive else 503, "application/json", body, head)
            elif path == "/readyz":
                s = status()
                ok = s.ready
                self._send(200 if ok else 503, "text/plain", b"ok\n" if ok else b"not ready\n", head)
            else:
                assert registry is not None
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry), head)

        def _error(self, code: int, head_only: bool, *, allow: str | None = None) -> None:
            body = f"{code} {self.responses.get(code, ('error',))[0].lower()}\n".encode()
            self.send_response(code)
            if allow is not None:
                self.send_header("Allow", allow)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            if not head_only:
                self.wfile.write(body)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            # parse_request() answers malformed requests through here: our plain, non-echoing body, and
            # always a status line (it may have recorded "HTTP/0.9" before it found the syntax error).
            self.close_connection = True
            if not self.request_version.startswith("HTTP/1."):
                self.request_version = self.default_request_version
            self._error(code, self.command == "HEAD")

        def _send(self, code: int, ctype: str, body: bytes, head: bool) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http.request", request=self.requestline[:200])

    return Handler


def _end_of_head(buf: bytearray) -> int:
    """Index of the blank line that ends the request head (CRLF or bare LF line ends), or -1."""
    ends = [i for i in (buf.find(b"\n\r\n"), buf.find(b"\n\n")) if i >= 0]
    return min(ends) if ends else -1
