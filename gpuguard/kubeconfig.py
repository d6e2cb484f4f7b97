"""Where the API server is and how to prove who we are: the in-cluster ServiceAccount, a kubeconfig gpuguard
reads itself (a token, a token file or a client certificate), and the kubernetes package's loader for the
kubeconfigs only it understands (exec plugins, auth providers, merged KUBECONFIG lists), imported only then:
importing it loads all of its generated models, +42 MB of RSS and ~280 ms of start-up on every GPU node (make
bench). The result is `Credentials`, which `gpuguard.kubeapi.Client` connects with.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import ipaddress
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import getproxies

import yaml

from gpuguard.errors import ConfigError

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


def credentials(kubeconfig: str | None) -> Credentials:
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


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())
