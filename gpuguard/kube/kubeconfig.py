"""Where the API server is and how to prove who we are: the in-cluster ServiceAccount, a kubeconfig gpuguard
reads itself (a token, a token file or a client certificate), and the kubernetes package's loader for the
kubeconfigs only it understands (exec plugins, auth providers, merged KUBECONFIG lists), imported only then:
importing it loads all of its generated models, +42 MB of RSS and ~280 ms of start-up on every GPU node (make
bench). The result is `Credentials`, which `gpuguard.kube.client.Client` connects with.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import ipaddress
import logging
import os
import shutil
import ssl
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import getproxies

import yaml

from gpuguard.core import files
from gpuguard.core.errors import ConfigError

# Bounds of what is read (gpuguard.core.files): a kubeconfig with the embedded certificates of a hundred
# clusters is a few hundred KiB; a token about 1 KiB; a CA bundle, a certificate or a key a few KiB.
MAX_KUBECONFIG = 4 * files.MIB
MAX_TOKEN = 64 * files.KIB
MAX_PEM = files.MIB

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
        for listed in paths:  # bounded before the loader reads them (a missing one is skipped, as kubectl)
            if os.path.lexists(listed):
                files.check_file(listed, limit=MAX_KUBECONFIG, what="kubeconfig")
        return _via_kubernetes(None)  # kubectl merges the list; so does the kubernetes loader
    return from_kubeconfig(paths[0] if paths else str(Path.home() / ".kube" / "config"))


def named(kubeconfig: str | None) -> bool:
    """Whether a cluster is named: a kubeconfig given, or in-cluster ($KUBECONFIG and ~/.kube/config are not
    looked at). A dry run reads the real cluster only then: a laptop demo must not wait on a default
    kubeconfig's dead server."""
    return bool(kubeconfig or os.environ.get("KUBERNETES_SERVICE_HOST"))


def in_cluster(sa_dir: str = SA_DIR) -> Credentials:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise ConfigError("in-cluster config: KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set")
    token, ca = Path(sa_dir, "token"), Path(sa_dir, "ca.crt")
    for f, limit in ((token, MAX_TOKEN), (ca, MAX_PEM)):
        if not f.is_file() or f.stat().st_size == 0:
            raise ConfigError(
                f"in-cluster config: {f} is missing or empty (is a ServiceAccount token mounted?)"
            )
        files.check_file(f, limit=limit, what="in-cluster config:")
    _check_ca(str(ca), f"in-cluster config: {ca}")
    if ":" in host:
        host = f"[{host}]"  # IPv6
    return Credentials(server=f"https://{host}:{port}", ca_file=str(ca), token_file=str(token))


def from_kubeconfig(path: str) -> Credentials:
    """The current context of a kubeconfig: token, token file or client certificate read here; any other
    kind of user (exec plugin, auth provider, basic auth, impersonation) through the kubernetes loader.
    ConfigError, one line naming the file and what is wrong in it, for anything that cannot work."""
    doc = _parse(files.read_text(path, limit=MAX_KUBECONFIG, what="kubeconfig"), path)
    if not isinstance(doc, dict):
        raise ConfigError(f"kubeconfig {path}: not a kubeconfig (no mapping at the top)")
    current = doc.get("current-context")
    if not current:
        raise ConfigError(f"kubeconfig {path}: no current-context")
    if not isinstance(current, str):
        raise ConfigError(f"kubeconfig {path}: current-context must be a name (a string)")
    context = _named(doc, "contexts", "context", current, path)
    cluster_name, user_name = context.get("cluster"), context.get("user")
    for field, value in (("cluster", cluster_name), ("user", user_name)):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"kubeconfig {path}: context {current!r}: {field} must be a name (a string)")
    cluster = _named(doc, "clusters", "cluster", str(cluster_name), path)
    user = _named(doc, "users", "user", user_name, path) if user_name else {}
    if set(user) - _OWN_USER_KEYS or set(cluster) - _OWN_CLUSTER_KEYS:
        return _via_kubernetes(path, plugin=_plugin(user, Path(path).resolve().parent, path))
    base = Path(path).resolve().parent
    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        raise ConfigError(f"kubeconfig {path}: cluster {cluster_name!r} has no server")
    insecure = cluster.get("insecure-skip-tls-verify", False)
    if not isinstance(insecure, bool):  # the string "false" is true to bool(): never guess towards no TLS
        raise ConfigError(f"kubeconfig {path}: insecure-skip-tls-verify must be true or false")
    token, token_file = _text(user, "token", path), _text(user, "tokenFile", path)
    if token:
        bearer_token(token, f"kubeconfig {path}: token")
    if token_file:
        token_file = str(base / token_file)
        files.check_file(token_file, limit=MAX_TOKEN, what=f"kubeconfig {path}: tokenFile")
    ca = _file_or_data(cluster, "certificate-authority", base, path)
    cert = _file_or_data(user, "client-certificate", base, path)
    key = _file_or_data(user, "client-key", base, path)
    if ca is not None:
        _check_ca(ca[0], f"kubeconfig {path}: {ca[1]}")
    if (cert is None) != (key is None):
        raise ConfigError(
            f"kubeconfig {path}: a client certificate needs both client-certificate and client-key"
        )
    if cert is not None and key is not None:
        _check_client_cert(cert, key, f"kubeconfig {path}")
    env = getproxies()
    return Credentials(
        server=server,
        # As kubectl (client-go) does: HTTPS_PROXY/HTTP_PROXY by the server's scheme, unless NO_PROXY matches.
        proxy=_unless_bypassed(server, env.get(urlparse(server).scheme) or env.get("all"), env.get("no", "")),
        ca_file=ca[0] if ca else None,
        insecure=insecure,
        token=token or None,
        token_file=token_file or None,
        cert_file=cert[0] if cert else None,
        key_file=key[0] if key else None,
    )


def bearer_token(token: str, where: str) -> str:
    """`token` when it can be sent in an Authorization header (visible ASCII, no space); ConfigError naming
    `where` otherwise: a newline in it would be a second header, refused by urllib3 at every request."""
    if not token or not all("!" <= ch <= "~" for ch in token):
        raise ConfigError(f"{where}: not a bearer token (empty, or holds spaces or control characters)")
    return token


def _parse(text: str, path: str) -> Any:
    """The kubeconfig's YAML; one line naming the file, the line and the problem when it is not YAML."""
    return files.parse_yaml(text, what=f"kubeconfig {path}")


def _named(doc: dict[str, Any], section: str, key: str, name: str, path: str) -> dict[str, Any]:
    entries = doc.get(section) or []
    if not isinstance(entries, list):
        raise ConfigError(f"kubeconfig {path}: {section} must be a list")
    for entry in entries:
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(key) or {}
            if not isinstance(value, dict):
                raise ConfigError(f"kubeconfig {path}: {key} {name!r} must be a mapping")
            return value
    raise ConfigError(f"kubeconfig {path}: no {key} named {name!r} in {section}")


def _text(entry: Mapping[str, Any], key: str, path: str) -> str | None:
    value = entry.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"kubeconfig {path}: {key} must be a string")
    return value


def _file_or_data(entry: Mapping[str, Any], key: str, base: Path, path: str) -> tuple[str, str] | None:
    """(the file TLS reads, how an error names it: the file, or `key`-data) or None."""
    data = _text(entry, f"{key}-data", path)
    if data:
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"kubeconfig {path}: {key}-data is not base64") from None
        if len(raw) > MAX_PEM:
            raise ConfigError(f"kubeconfig {path}: {key}-data is more than {files.size_text(MAX_PEM)}")
        return _private_file(raw), f"{key}-data"
    name = _text(entry, key, path)
    if name:
        file = str(base / name)
        files.check_file(file, limit=MAX_PEM, what=f"kubeconfig {path}: {key}")
        return file, f"{key} {file}"
    return None


def _check_ca(file: str, where: str, *, kind: str = "CA certificate") -> None:
    """The file holds PEM certificates: found now, naming it, not as an SSLError at the first request."""
    try:
        ssl.create_default_context(cafile=file)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ConfigError(f"{where}: not a PEM {kind}{_ssl_reason(exc)}") from None


def _check_client_cert(cert: tuple[str, str], key: tuple[str, str], where: str) -> None:
    """The client certificate and its key load together; else one line naming the file at fault, not
    `SSLError: [SSL] PEM lib (_ssl.c:3905)` at every request. (file, how an error names it) each."""
    _check_ca(cert[0], f"{where}: {cert[1]}", kind="certificate")
    try:
        ssl.create_default_context().load_cert_chain(cert[0], key[0])
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ConfigError(
            f"{where}: {key[1]}: not a PEM private key that matches {cert[1]}{_ssl_reason(exc)}"
        ) from None


def _ssl_reason(exc: Exception) -> str:
    """OpenSSL's reason where it has one (" (KEY_VALUES_MISMATCH)"); "PEM lib (_ssl.c:3905)" says nothing."""
    reason = getattr(exc, "reason", None) if isinstance(exc, ssl.SSLError) else getattr(exc, "strerror", None)
    return f" ({' '.join(str(reason).split())[:120]})" if reason else ""


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


def _plugin(user: Mapping[str, Any], base: Path, path: str) -> str | None:
    """The user's exec login plugin (aws, gke-gcloud-auth-plugin, kubelogin), None if it has none; a plugin
    that is not installed is a ConfigError naming it and the kubeconfig. The kubernetes loader would log
    `ERROR:root:` and go on with no credentials: every request then fails as unreachable or anonymous."""
    exec_ = user.get("exec")
    if not isinstance(exec_, dict):
        return None
    command = exec_.get("command")
    if not isinstance(command, str) or not command:
        raise ConfigError(f"kubeconfig {path}: the user's exec plugin has no command")
    # As client-go: a command with a path separator is relative to the kubeconfig's folder, else on PATH.
    found = str(base / command) if os.sep in command and os.access(base / command, os.X_OK) else None
    if found is None and shutil.which(command) is None:
        raise ConfigError(
            f"kubeconfig {path}: the exec login plugin {command!r} is not installed (not found on PATH); "
            "install it (e.g. the cloud's CLI) or use a kubeconfig with a token or a client certificate"
        )
    return command


class _Logged(logging.Handler):
    """The kubernetes loader's `logging.error` lines (a failed exec plugin), kept instead of printed."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _via_kubernetes(path: str | None, *, plugin: str | None = None) -> Credentials:
    """The kubernetes package's loader, for what gpuguard does not read itself. Heavy import: only here."""
    from kubernetes import client  # noqa: PLC0415
    from kubernetes import config as _config  # noqa: PLC0415
    from kubernetes.config.config_exception import ConfigException  # noqa: PLC0415

    loader: Any = _config  # untyped
    configuration: Any = client.Configuration()
    where = f"kubeconfig {path or '$KUBECONFIG'}"
    logged = _Logged()
    root = logging.getLogger()
    root.addHandler(logged)  # with a handler there, logging.error does not add its stderr one either
    try:
        loader.load_kube_config(config_file=path, client_configuration=configuration)
    except (ConfigException, OSError, TypeError, ValueError, AttributeError, KeyError, yaml.YAMLError) as exc:
        raise ConfigError(f"{where}: {_one_line(exc)[:300]}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    finally:
        root.removeHandler(logged)
    if logged.lines:  # the loader swallowed a failed login: no request must go out anonymous
        name = f"the exec login plugin {plugin!r}" if plugin else "the login"
        raise ConfigError(f"{where}: {name} failed: {_one_line(logged.lines[-1])[:300]}")

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
