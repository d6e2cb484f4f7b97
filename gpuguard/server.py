"""/healthz, /readyz and /metrics on a small threaded HTTP server.

/healthz is liveness: 200 while the check loop has completed a check within the last 3 intervals, whatever
the GPUs say (a sick GPU must not make kubelet restart the agent). /readyz: 200 after the first complete
check and node reconcile. Only GET and HEAD on these three paths; requests are small and time-limited.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import UTC
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gpuguard.agent import AgentStatus

log = structlog.get_logger("gpuguard.server")

REQUEST_TIMEOUT = 5.0
MAX_REQUEST_LINE = 2048


def health_body(s: AgentStatus) -> dict[str, Any]:
    """The /healthz JSON contract (exactly these keys)."""
    v = s.verdict
    return {
        "agent": "ok" if s.alive else "stalled",
        "node": s.node,
        "healthy": v.healthy if v is not None else False,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "healthy": g.healthy,
                "reasons": [f.message for f in g.faults],
            }
            for g in (v.gpus if v is not None else ())
        ],
        "tainted": s.tainted,
        "cordoned": s.cordoned,
        "dry_run": s.dry_run,
        "last_check": s.last_check.astimezone(UTC).isoformat().replace("+00:00", "Z")
        if s.last_check
        else None,
    }


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
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="gpuguard-http",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _make_handler(
    status: Callable[[], AgentStatus], registry: CollectorRegistry | None
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT  # a slow client cannot hold a thread forever
        server_version = "gpuguard"
        sys_version = ""

        def do_GET(self) -> None:
            self._serve(head=False)

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def _serve(self, *, head: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                s = status()
                body = json.dumps(health_body(s)).encode()
                self._send(200 if s.alive else 503, "application/json", body, head)
            elif path == "/readyz":
                s = status()
                ok = s.ready
                self._send(200 if ok else 503, "text/plain", b"ok\n" if ok else b"not ready\n", head)
            elif path == "/metrics" and registry is not None:
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry), head)
            else:
                self._send(404, "text/plain", b"not found\n", head)

        def _method_not_allowed(self) -> None:
            self.send_response(405)
            self.send_header("Allow", "GET, HEAD")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _method_not_allowed

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
