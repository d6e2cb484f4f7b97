"""The Kubernetes API for gpuguard's five kinds of request and its one watch: one urllib3 pool, TLS, a bearer
token or a client certificate, JSON in and out.

Why not the kubernetes package's CoreV1Api: importing it loads all of its generated models, +42 MB of RSS
and ~280 ms of start-up on every GPU node (make bench), for five requests. The package stays a dependency
for the kubeconfigs that only its loader understands (exec plugins, auth providers, merged KUBECONFIG
lists): `load()` hands those to it and takes back the server, the TLS files and the token it resolved. The
in-cluster path (the DaemonSet) and plain token or certificate kubeconfigs never import it.

Errors are mapped here, where the codes are known, into gpuguard's own (`gpuguard.core.errors`): 409 is a
`ConflictError`; 429, 5xx, no answer (connection, TLS, timeout) and an answer that is not JSON (a proxy's
error page) are a `TransientApiError` (with Retry-After); any other status >= 400 a `PermanentApiError`.
Callers never translate library exceptions again.

Each client also holds a client-side rate limit (`gpuguard.kube.ratelimit.RateLimiter`).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode

import structlog
import urllib3
from urllib3.connection import HTTPConnection
from urllib3.exceptions import HTTPError

from gpuguard import __version__
from gpuguard.core import files
from gpuguard.core.errors import ConfigError, ConflictError, PermanentApiError, TransientApiError
from gpuguard.kube.bounded import Dropped, Lines, Splitter, TooLarge, dropped_event
from gpuguard.kube.kubeconfig import MAX_TOKEN, Credentials, bearer_token, credentials
from gpuguard.kube.ratelimit import RateLimiter

log = structlog.get_logger(__name__)

_MAX_MESSAGE = 300
# The most bytes of one object a read keeps (a list's item, a watch's event), unless its reader says less: an
# honest node or rule is a few KiB to a few hundred (a node's 256 KiB of annotations at most), and etcd
# stores no object over 1.5 MiB. A larger one is dropped as it streams (counted: `dropped`), never kept.
MAX_OBJECT = 1024 * 1024
# The most bytes of an answer kept whole besides its items (one object read, a list's envelope): the API
# server refuses any request body over 3 MiB, so no object it serves is larger.
MAX_RESPONSE = 3 * 1024 * 1024
_CHUNK = 65536
# Every request's User-Agent; the managedFields' manager of every write (gpuguard).
USER_AGENT = f"gpuguard/{__version__}"


def _keepalive() -> list[tuple[int, int, int]]:
    """TCP keepalive on every connection to the API server: the budget's watch
    (quarantine/node/budgetwatch.py) is held for up to an hour, and a connection that a NAT or load balancer
    dropped in silence would otherwise be noticed only at its end. Probes after 60 s of silence, 3 of them
    20 s apart: found dead within about two minutes, by the kernel (no request, no wake-up of ours)."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 20), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timing
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return options


SOCKET_OPTIONS = [*HTTPConnection.default_socket_options, *_keepalive()]

# gpuguard's watches (quarantine/node/budgetwatch.py, quarantine/gpu/watch.py): the server ends each after
# timeoutSeconds, drawn per watch between these (the API server takes any value, docs/design.md): the agent
# resumes from the last resourceVersion, one cheap request per watch about once an hour (1.5 a second at
# 5,000 agents), served from the watch cache, spread over the hour by the draw. A connection that died
# silently meanwhile (a NAT or load balancer dropped it) is found by TCP keepalive (above) within about two
# minutes, not at the end of the hour.
WATCH_SECONDS = (2880, 3600)


class Client:
    """A keep-alive connection pool to one API server. Thread-safe (urllib3's pool is)."""

    def __init__(
        self,
        creds: Credentials,
        *,
        user_agent: str,
        rate_limiter: RateLimiter | None = None,
        dropped: Callable[[str], None] | None = None,
    ) -> None:
        """`dropped`: called with a read's `what` for each object it dropped over its cap (a metric)."""
        if not creds.server.startswith(("https://", "http://")):
            raise ConfigError(f"API server {creds.server!r} is not an http(s) URL")
        self.creds = creds
        self.rate_limiter = rate_limiter
        self._dropped = dropped
        self._told: set[str] = set()  # the reads whose dropped object was logged (once each)
        self._server = creds.server.rstrip("/")
        self._user_agent = user_agent
        self._token_lock = threading.Lock()
        self._token_cache: tuple[float, str] | None = None
        tls: dict[str, Any] = {}
        if creds.server.startswith("https://"):
            if creds.insecure:
                tls["cert_reqs"] = "CERT_NONE"
            else:
                tls["cert_reqs"] = "CERT_REQUIRED"
                if creds.ca_file:
                    tls["ca_certs"] = creds.ca_file
            if creds.cert_file:
                tls["cert_file"] = creds.cert_file
                tls["key_file"] = creds.key_file
            if creds.tls_server_name:
                tls["server_hostname"] = creds.tls_server_name
        # maxsize 4: the writer thread, the budget's watch and count (quarantine/node/budgetwatch.py),
        # `gpuguard status`.
        pool: dict[str, Any] = {
            "num_pools": 1,
            "maxsize": 4,
            "retries": False,
            "socket_options": SOCKET_OPTIONS,
            **tls,
        }
        self._pool: urllib3.PoolManager = (
            urllib3.ProxyManager(creds.proxy, **pool) if creds.proxy else urllib3.PoolManager(**pool)
        )

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        accept: str = "application/json",
        timeout: float = 10.0,
        what: str = "",
        tokens: float = 1.0,
        keep: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        max_item: int = MAX_OBJECT,
    ) -> Any:
        """One request; the decoded JSON answer. `what` ("read node n") starts every error's message.
        ConflictError, TransientApiError or PermanentApiError (see the module's docstring) otherwise.
        `tokens`: what it takes from the rate limiter, 1 a request; a caller that reserved a request's
        token earlier (quarantine/node/writers.py: a read-modify-write) says so explicitly (2 for the read, 0
        for the write).

        Read bounded as it streams (`gpuguard.kube.bounded`): a list's items one at a time, each over
        `max_item` bytes dropped (`dropped`, logged once as `kube.object_dropped`), each kept one passed
        through `keep` as it arrives; the rest of the answer at most MAX_RESPONSE bytes (else a
        TransientApiError)."""
        what = what or f"{method} {path}"
        headers = {"Accept": accept, "User-Agent": self._user_agent}
        auth = self._authorization()
        if auth:
            headers["Authorization"] = auth
        data = None
        if body is not None:
            data = json.dumps(body, separators=(",", ":")).encode()
            headers["Content-Type"] = content_type
        url = self._server + path + (f"?{urlencode(query)}" if query else "")
        if self.rate_limiter is not None:
            self.rate_limiter.acquire(tokens)
        try:
            resp = self._pool.request(
                method,
                url,
                body=data,
                headers=headers,
                timeout=urllib3.Timeout(total=timeout),
                retries=False,
                preload_content=False,
            )
        except (HTTPError, OSError) as exc:
            raise TransientApiError(f"{what}: {type(exc).__name__}: {exc}") from exc
        read = False  # the whole answer: the connection can be reused
        try:
            if resp.status >= 400:
                body = resp.read(MAX_RESPONSE)
                read = not resp.read(1)
                _raise_for_status(resp, what, body)
            doc = self._decode(resp, what, keep=keep, max_item=max_item)
            read = True
            return doc
        except (HTTPError, OSError) as exc:
            raise TransientApiError(f"{what}: {type(exc).__name__}: {exc}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError, TooLarge) as exc:
            # An answer that is not JSON (a proxy's error page) is as good as no answer.
            raise TransientApiError(f"{what}: {type(exc).__name__}: {exc}", status=resp.status) from exc
        finally:
            if not read:
                resp.close()
            resp.release_conn()

    def _decode(
        self,
        resp: urllib3.BaseHTTPResponse,
        what: str,
        *,
        keep: Callable[[dict[str, Any]], dict[str, Any]] | None,
        max_item: int,
    ) -> Any:
        """The answer's JSON. Up to `max_item` bytes it is read whole (every answer but a large list's);
        past that, cut into its items while it streams."""
        head: list[bytes] = []
        chunks = resp.stream(_CHUNK)
        for chunk in chunks:
            head.append(chunk)
            if sum(map(len, head)) > max_item:
                break
        else:  # read whole; its items kept as a list of them would be
            doc: Any = json.loads(b"".join(head)) if head else None
            if keep is not None and isinstance(doc, dict) and isinstance(doc.get("items"), list):
                doc["items"] = [keep(i) for i in doc["items"]]
            return doc
        splitter = Splitter(max_item=max_item, max_rest=MAX_RESPONSE)
        kept: list[dict[str, Any]] = []
        for chunk in itertools.chain(head, chunks):
            kept.extend((keep or _whole)(json.loads(item)) for item in splitter.feed(chunk))
        doc = json.loads(splitter.end())
        if isinstance(doc, dict) and "items" in doc:
            doc["items"] = kept
        for _ in range(splitter.dropped):
            self._dropped_one(what, max_item)
        return doc

    def _dropped_one(self, what: str, cap: int) -> None:
        if self._dropped is not None:
            self._dropped(what)
        if what not in self._told:
            self._told.add(what)
            log.warning(
                "kube.object_dropped",
                read=what,
                max_bytes=cap,
                note="an object over the cap, dropped as it streamed, is absent to this read (logged once a "
                "read; gpuguard_api_objects_dropped_total counts each)",
            )

    def watch(
        self,
        path: str,
        *,
        query: Mapping[str, str],
        accept: str = "application/json",
        timeout: float = 10.0,
        idle: float = 330.0,
        what: str = "",
        max_item: int = MAX_OBJECT,
    ) -> Iterator[dict[str, Any]]:
        """A watch, started before this returns (`query` carries watch=1, the resourceVersion and the
        server's timeoutSeconds): each event ({"type", "object"}) as the server sends it, until the server
        ends the stream. `idle`: the longest silence before the connection counts as dead (more than
        timeoutSeconds; bookmarks come sooner). The errors of request(), also for a stream that breaks.

        An event over `max_item` bytes is dropped as it streams, never held whole (`dropped`, logged once as
        `kube.object_dropped`); in its place comes {"type": "DROPPED", "object": {"metadata": {"name",
        "resourceVersion"}}}, read from the line's head, so that the reader can treat the object as absent,
        as a list does."""
        what = what or f"watch {path}"
        headers = {"Accept": accept, "User-Agent": self._user_agent}
        auth = self._authorization()
        if auth:
            headers["Authorization"] = auth
        url = self._server + path + f"?{urlencode(query)}"
        try:
            resp = self._pool.request(
                "GET",
                url,
                headers=headers,
                timeout=urllib3.Timeout(connect=timeout, read=idle),
                retries=False,
                preload_content=False,
            )
        except (HTTPError, OSError) as exc:
            raise TransientApiError(f"{what}: {type(exc).__name__}: {exc}") from exc
        if resp.status >= 400:
            body = b""
            try:
                body = resp.read(MAX_RESPONSE)
            except (HTTPError, OSError):
                pass
            finally:
                resp.release_conn()
            _raise_for_status(resp, what, body)
        return self._events(resp, what, max_item)

    def _events(self, resp: urllib3.BaseHTTPResponse, what: str, max_item: int) -> Iterator[dict[str, Any]]:
        """A watch's events, one JSON document a line, until the server ends the stream."""
        ended = False
        lines = Lines(max_item=max_item)
        try:
            for chunk in resp.stream(_CHUNK):
                for line in lines.feed(chunk):
                    if not isinstance(line, Dropped):
                        yield json.loads(line)
                        continue
                    self._dropped_one(what, max_item)
                    event = dropped_event(line)
                    if event is not None:
                        yield event
            ended = True
        except (HTTPError, OSError) as exc:
            raise TransientApiError(f"{what}: {type(exc).__name__}: {exc}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TransientApiError(f"{what}: {type(exc).__name__}: {exc}", status=resp.status) from exc
        finally:
            if not ended:
                resp.close()  # left mid-stream: the connection is not reusable
            # Ended by the server (its timeoutSeconds): the connection is kept for the next watch.
            resp.release_conn()

    def _authorization(self) -> str | None:
        creds = self.creds
        if creds.authorization is not None:
            return creds.authorization()
        if creds.token_file:
            return f"Bearer {self._file_token(creds.token_file)}"
        return f"Bearer {creds.token}" if creds.token else None

    def _file_token(self, path: str) -> str:
        """The token file's content, read again whenever its mtime moves (kubelet rotates it in place)."""
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            mtime = -1.0
        with self._token_lock:
            cached = self._token_cache
            if cached is not None and cached[0] == mtime:
                return cached[1]
            try:
                token = bearer_token(
                    files.read_text(path, limit=MAX_TOKEN, what="token file").strip(), f"token file {path}"
                )
            except ConfigError as exc:
                if cached is not None:
                    return cached[1]  # mid-rotation: the old token is still valid for a while
                # No token to send: as good as no answer (retried); the line names the file and the problem.
                raise TransientApiError(str(exc)) from None
            self._token_cache = (mtime, token)
            return token


def path_of(*parts: str) -> str:
    """An API path with each name segment escaped: path_of("api/v1/nodes", name)."""
    head, *names = parts
    return "/" + head + "".join("/" + quote(n, safe="") for n in names)


def load(
    kubeconfig: str | None,
    *,
    user_agent: str = USER_AGENT,
    rate_limiter: RateLimiter | None = None,
    dropped: Callable[[str], None] | None = None,
) -> Client:
    """A client for the given kubeconfig; else in-cluster, then $KUBECONFIG, then ~/.kube/config
    (the kubernetes client's order). ConfigError, naming the file and the reason, when none is usable.
    rate_limiter: the client-side limit (--api-qps, --api-burst); None: no limit (`status`, `uninstall`)."""
    return Client(credentials(kubeconfig), user_agent=user_agent, rate_limiter=rate_limiter, dropped=dropped)


def _whole(item: dict[str, Any]) -> dict[str, Any]:
    return item


def _raise_for_status(resp: urllib3.BaseHTTPResponse, what: str, data: bytes) -> None:
    if resp.status < 400:
        return
    message = _message(data, resp.reason)
    if resp.status == 409:
        raise ConflictError(f"{what}: conflict: {message}")
    if resp.status == 429 or resp.status >= 500:
        raise TransientApiError(
            f"{what}: HTTP {resp.status}: {message}",
            status=resp.status,
            retry_after=_retry_after(resp.headers),
        )
    raise PermanentApiError(f"{what}: HTTP {resp.status}: {message}", status=resp.status)


def _message(data: bytes, reason: str | None) -> str:
    try:
        doc = json.loads(data)
        text = doc.get("message") if isinstance(doc, dict) else None
    except ValueError:
        text = None
    return _one_line(text or reason or "no message")[:_MAX_MESSAGE]


def _retry_after(headers: Mapping[str, str]) -> float | None:
    value = headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())
