"""The Kubernetes API for gpuguard's five kinds of request and its one watch: one urllib3 pool, TLS, a bearer
token or a client certificate, JSON in and out.

Why not the kubernetes package's CoreV1Api: importing it loads all of its generated models, +42 MB of RSS
and ~280 ms of start-up on every GPU node (make bench), for five requests. The package stays a dependency
for the kubeconfigs that only its loader understands (exec plugins, auth providers, merged KUBECONFIG
lists): `load()` hands those to it and takes back the server, the TLS files and the token it resolved. The
in-cluster path (the DaemonSet) and plain token or certificate kubeconfigs never import it.

Errors are mapped here, where the codes are known, into gpuguard's own (`gpuguard.errors`): 409 is a
`ConflictError`; 429, 5xx, no answer (connection, TLS, timeout) and an answer that is not JSON (a proxy's
error page) are a `TransientApiError` (with Retry-After); any other status >= 400 a `PermanentApiError`.
Callers never translate library exceptions again.

Each client also holds a client-side rate limit (`RateLimiter`, client-go's token bucket; a request takes one
token, and a caller that reserves a later request's token says so: `request(tokens=...)`, the node writer's
read-modify-write): a fault's few requests fit in its burst and wait for nothing, while an
agent whose loop goes wrong (a conflict storm, a retry bug) is held to a few requests a second instead of
hammering the API server once per agent of a 5,000-node fleet.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import ipaddress
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlparse
from urllib.request import getproxies

import urllib3
import yaml
from urllib3.connection import HTTPConnection
from urllib3.exceptions import HTTPError

from gpuguard.errors import ConfigError, ConflictError, PermanentApiError, TransientApiError

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# What a kubeconfig user may hold for gpuguard to read it itself; anything else goes to the kubernetes loader.
_OWN_USER_KEYS = frozenset(
    {"token", "tokenFile", "client-certificate", "client-certificate-data", "client-key", "client-key-data"}
)
_OWN_CLUSTER_KEYS = frozenset(
    {
        "server",
        "certificate-authority",
        "certificate-authority-data",
        "insecure-skip-tls-verify",
        "extensions",
    }
)
_MAX_MESSAGE = 300


def _keepalive() -> list[tuple[int, int, int]]:
    """TCP keepalive on every connection to the API server: the budget's watch (node/fleet.py) is held for
    up to an hour, and a connection that a NAT or load balancer dropped in silence would otherwise be
    noticed only at its end. Probes after 60 s of silence, 3 of them 20 s apart: found dead within about
    two minutes, by the kernel (no request, no wake-up of ours)."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 20), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timing
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return options


SOCKET_OPTIONS = [*HTTPConnection.default_socket_options, *_keepalive()]

# gpuguard's watches (node/fleet.py, node/devicewatch.py): the server ends each after timeoutSeconds, drawn
# per watch between these (the API server takes any value, docs/design.md): the agent resumes from the last
# resourceVersion, one cheap request per watch about once an hour (1.5 a second at 5,000 agents), served from
# the watch cache, spread over the hour by the draw. A connection that died silently meanwhile (a NAT or load
# balancer dropped it) is found by TCP keepalive (above) within about two minutes, not at the end of the hour.
WATCH_SECONDS = (2880, 3600)


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to prove who we are. Files, not bytes: TLS wants paths."""

    server: str
    ca_file: str | None = None
    insecure: bool = False
    token: str | None = None
    # Re-read when it changes: a projected ServiceAccount token is rotated by the kubelet (1 h lifetime).
    token_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    # The "Authorization" header from the kubernetes loader (refreshes exec-plugin tokens itself).
    authorization: Callable[[], str | None] | None = None
    proxy: str | None = None
    tls_server_name: str | None = None


class RateLimiter:
    """A token bucket (client-go's client-side limit): on average `qps` requests a second, up to `burst` at
    once. Thread-safe; each caller reserves its token and sleeps for its own share, so requests leave in the
    order they asked. qps 0: no limit."""

    def __init__(
        self,
        qps: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if qps < 0 or burst < 1:
            raise ConfigError("a rate limit needs qps >= 0 and burst >= 1")
        self.qps, self.burst = qps, burst
        self._clock, self._sleep = clock, sleep
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()
        self.waited = 0.0
        """Seconds callers have slept here in all (the bench reports it)."""

    def acquire(self, tokens: float = 1.0) -> float:
        """Take `tokens`, sleeping until they are there; the seconds slept."""
        if self.qps == 0 or tokens <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
            self._last = now
            self._tokens -= tokens
            wait = -self._tokens / self.qps if self._tokens < 0 else 0.0
            self.waited += wait
        if wait > 0:
            self._sleep(wait)
        return wait


class Client:
    """A keep-alive connection pool to one API server. Thread-safe (urllib3's pool is)."""

    def __init__(
        self, creds: Credentials, *, user_agent: str, rate_limiter: RateLimiter | None = None
    ) -> None:
        if not creds.server.startswith(("https://", "http://")):
            raise ConfigError(f"API server {creds.server!r} is not an http(s) URL")
        self.creds = creds
        self.rate_limiter = rate_limiter
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
        # maxsize 4: the writer thread, the budget's watch and count (node/fleet.py), `gpuguard status`.
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
    ) -> Any:
        """One request; the decoded JSON answer. `what` ("read node n") starts every error's message.
        ConflictError, TransientApiError or PermanentApiError (see the module's docstring) otherwise.
        `tokens`: what it takes from the rate limiter, 1 a request; a caller that reserved a request's
        token earlier (node/writers.py: a read-modify-write) says so explicitly (2 for the read, 0 for the
        write)."""
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
                method, url, body=data, headers=headers, timeout=urllib3.Timeout(total=timeout), retries=False
            )
        except (HTTPError, OSError) as exc:
            raise TransientApiError(f"{what}: {type(exc).__name__}: {exc}") from exc
        _raise_for_status(resp, what)
        try:
            return json.loads(resp.data) if resp.data else None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            # An answer that is not JSON (a proxy's error page) is as good as no answer.
            raise TransientApiError(f"{what}: {type(exc).__name__}: {exc}", status=resp.status) from exc

    def watch(
        self,
        path: str,
        *,
        query: Mapping[str, str],
        accept: str = "application/json",
        timeout: float = 10.0,
        idle: float = 330.0,
        what: str = "",
    ) -> Iterator[dict[str, Any]]:
        """A watch, started before this returns (`query` carries watch=1, the resourceVersion and the
        server's timeoutSeconds): each event ({"type", "object"}) as the server sends it, until the server
        ends the stream. `idle`: the longest silence before the connection counts as dead (more than
        timeoutSeconds; bookmarks come sooner). The errors of request(), also for a stream that breaks."""
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
            try:
                resp.read()
            except (HTTPError, OSError):
                pass
            finally:
                resp.release_conn()
            _raise_for_status(resp, what)
        return _events(resp, what)

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
                token = Path(path).read_text().strip()
            except OSError:
                if cached is not None:
                    return cached[1]  # mid-rotation: the old token is still valid for a while
                raise
            self._token_cache = (mtime, token)
            return token


def path_of(*parts: str) -> str:
    """An API path with each name segment escaped: path_of("api/v1/nodes", name)."""
    head, *names = parts
    return "/" + head + "".join("/" + quote(n, safe="") for n in names)


def load(kubeconfig: str | None, *, user_agent: str, rate_limiter: RateLimiter | None = None) -> Client:
    """A client for the given kubeconfig; else in-cluster, then $KUBECONFIG, then ~/.kube/config
    (the kubernetes client's order). ConfigError, naming the file and the reason, when none is usable."""
    return Client(_credentials(kubeconfig), user_agent=user_agent, rate_limiter=rate_limiter)


def _credentials(kubeconfig: str | None) -> Credentials:
    if kubeconfig:
        return from_kubeconfig(kubeconfig)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster()
    env = os.environ.get("KUBECONFIG", "")
    paths = [p for p in env.split(os.pathsep) if p]
    if len(paths) > 1:
        return _via_kubernetes(None)  # kubectl merges the list; so does the kubernetes loader
    return from_kubeconfig(paths[0] if paths else str(Path.home() / ".kube" / "config"))


def in_cluster(sa_dir: str = SA_DIR) -> Credentials:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise ConfigError("in-cluster config: KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set")
    token, ca = Path(sa_dir, "token"), Path(sa_dir, "ca.crt")
    for f in (token, ca):
        if not f.is_file() or f.stat().st_size == 0:
            raise ConfigError(
                f"in-cluster config: {f} is missing or empty (is a ServiceAccount token mounted?)"
            )
    if ":" in host:
        host = f"[{host}]"  # IPv6
    return Credentials(server=f"https://{host}:{port}", ca_file=str(ca), token_file=str(token))


def from_kubeconfig(path: str) -> Credentials:
    """The current context of a kubeconfig: token, token file or client certificate read here; any other
    kind of user (exec plugin, auth provider, basic auth, impersonation) through the kubernetes loader."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"kubeconfig {path}: {_one_line(exc)}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"kubeconfig {path}: not a kubeconfig (no mapping at the top)")
    current = doc.get("current-context")
    if not current:
        raise ConfigError(f"kubeconfig {path}: no current-context")
    context = _named(doc, "contexts", "context", str(current), path)
    cluster = _named(doc, "clusters", "cluster", str(context.get("cluster")), path)
    user_name = context.get("user")
    user = _named(doc, "users", "user", str(user_name), path) if user_name else {}
    if set(user) - _OWN_USER_KEYS or set(cluster) - _OWN_CLUSTER_KEYS:
        return _via_kubernetes(path)
    base = Path(path).resolve().parent
    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        raise ConfigError(f"kubeconfig {path}: cluster {context.get('cluster')!r} has no server")
    env = getproxies()
    return Credentials(
        server=server,
        # As kubectl (client-go) does: HTTPS_PROXY/HTTP_PROXY by the server's scheme, unless NO_PROXY matches.
        proxy=_unless_bypassed(server, env.get(urlparse(server).scheme) or env.get("all"), env.get("no", "")),
        ca_file=_file_or_data(cluster, "certificate-authority", base, path),
        insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        token=str(user["token"]) if user.get("token") else None,
        token_file=str(base / user["tokenFile"]) if user.get("tokenFile") else None,
        cert_file=_file_or_data(user, "client-certificate", base, path),
        key_file=_file_or_data(user, "client-key", base, path),
    )


def _named(doc: dict[str, Any], section: str, key: str, name: str, path: str) -> dict[str, Any]:
    for entry in doc.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(key) or {}
            if not isinstance(value, dict):
                break
            return value
    raise ConfigError(f"kubeconfig {path}: no {key} named {name!r} in {section}")


def _file_or_data(entry: Mapping[str, Any], key: str, base: Path, path: str) -> str | None:
    data = entry.get(f"{key}-data")
    if data:
        try:
            raw = base64.b64decode(str(data), validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"kubeconfig {path}: {key}-data is not base64") from None
        return _private_file(raw)
    if entry.get(key):
        return str(base / str(entry[key]))
    return None


_tmpdir: str | None = None


def _private_file(data: bytes) -> str:
    """TLS wants key and certificates as files: write embedded data into a 0700 directory removed at exit."""
    global _tmpdir  # noqa: PLW0603 - one directory per process
    if _tmpdir is None:
        _tmpdir = tempfile.mkdtemp(prefix="gpuguard-kube-")
        atexit.register(shutil.rmtree, _tmpdir, True)
    fd, name = tempfile.mkstemp(dir=_tmpdir)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return name


def _via_kubernetes(path: str | None) -> Credentials:
    """The kubernetes package's loader, for what gpuguard does not read itself. Heavy import: only here."""
    from kubernetes import client  # noqa: PLC0415
    from kubernetes import config as _config  # noqa: PLC0415
    from kubernetes.config.config_exception import ConfigException  # noqa: PLC0415

    loader: Any = _config  # untyped
    configuration: Any = client.Configuration()
    try:
        loader.load_kube_config(config_file=path, client_configuration=configuration)
    except (ConfigException, OSError, TypeError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"kubeconfig {path or '$KUBECONFIG'}: {_one_line(exc)}") from None

    def authorization() -> str | None:
        # The whole header value ("Bearer ..." or basic auth); refreshes an expired exec-plugin token first.
        value = configuration.auth_settings().get("BearerToken", {}).get("value")
        return str(value) if value else None

    return Credentials(
        server=str(configuration.host),
        ca_file=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        cert_file=configuration.cert_file,
        key_file=configuration.key_file,
        authorization=authorization,
        # The loader takes HTTPS_PROXY from the environment but leaves NO_PROXY to its own REST client.
        proxy=_unless_bypassed(str(configuration.host), configuration.proxy, configuration.no_proxy or ""),
        tls_server_name=getattr(configuration, "tls_server_name", None),
    )


def _unless_bypassed(server: str, proxy: str | None, no_proxy: str) -> str | None:
    """`proxy`, or None when NO_PROXY lists the server: "*", a host or domain suffix (".example.com" or
    "example.com"), host:port, an IP address or a CIDR range (the rules of client-go and the kubernetes
    package)."""
    if not proxy:
        return None
    url = urlparse(server)
    host = (url.hostname or "").lower()
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if not entry:
            continue
        if entry == "*":
            return None
        if ip is not None:
            try:
                if ip in ipaddress.ip_network(entry, strict=False):
                    return None
            except ValueError:
                pass
        domain = entry.lstrip(".")
        for name in (host, url.netloc.lower()):
            if name == domain or name.endswith("." + domain):
                return None
    return proxy


def _events(resp: urllib3.BaseHTTPResponse, what: str) -> Iterator[dict[str, Any]]:
    """A watch's events, one JSON document a line, until the server ends the stream."""
    ended = False
    try:
        buffer = b""
        for chunk in resp.stream(65536):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.strip():
                    yield json.loads(line)
        ended = True
    except (HTTPError, OSError) as exc:
        raise TransientApiError(f"{what}: {type(exc).__name__}: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TransientApiError(f"{what}: {type(exc).__name__}: {exc}", status=resp.status) from exc
    finally:
        if not ended:
            resp.close()  # left mid-stream: the connection is not reusable
        # Ended by the server (its timeoutSeconds): the connection is kept for the next watch, no handshake.
        resp.release_conn()


def _raise_for_status(resp: urllib3.BaseHTTPResponse, what: str) -> None:
    if resp.status < 400:
        return
    message = _message(resp.data, resp.reason)
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
