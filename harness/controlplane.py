"""A real, throwaway Kubernetes control plane (etcd + kube-apiserver) on 127.0.0.1.

Why: gpuguard talks to the API server (nodes, taints, tokens, RBAC); fakes drift from the
real thing, so the integration tests and ``make kube-up`` run the genuine binaries that
``hack/testenv/build.sh`` builds from the pinned Go modules. By default there is no
kube-controller-manager, scheduler or kubelet: tests create what those would (e.g.
ServiceAccounts) themselves. With ``components=("scheduler", "controller-manager", "kwok")``
(``up --with ...``) it also runs kube-scheduler, kube-controller-manager (every default
controller: service-account tokens, taint eviction, node life cycle, Deployments, ...) and
kwok, which heartbeats the nodes annotated ``kwok.x-k8s.io/node=fake`` and runs the pods bound
to them (hack/kwok/build.sh builds it; hack/testenv/kwok-stages.yaml says how fast). Optionally
(``"karpenter"``, never part of ``all``) also Karpenter's kwok provider, the autoscaler: its CRDs are
applied first, and it creates kwok nodes of the instance types in hack/karpenter/instance-types.json
for pending pods (hack/karpenter/build.sh builds it; tests/integration/test_karpenter.py uses it).

Use it as a CLI::

    python -m harness.controlplane up       # build if needed, start, print kubeconfig
    python -m harness.controlplane status   # exit 0 when up and ready
    python -m harness.controlplane down     # idempotent

or from Python (``from harness import controlplane``, as the integration tests and the bench do)::

    cp = ControlPlane(state_dir=tmp)   # .kube-test/ by default
    cp.start()
    ...                                # cp.kubeconfig_path, cp.url, cp.audit_events()
    cp.stop()

Only the standard library and ``cryptography`` are needed. Set ``GPUGUARD_TESTENV_CACHE``
to move the binary cache (build.sh honours it too).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTENV_DIR = REPO_ROOT / "hack" / "testenv"
BUILD_SCRIPT = TESTENV_DIR / "build.sh"
KWOK_BUILD_SCRIPT = REPO_ROOT / "hack" / "kwok" / "build.sh"
KWOK_STAGES = TESTENV_DIR / "kwok-stages.yaml"
KARPENTER_BUILD_SCRIPT = REPO_ROOT / "hack" / "karpenter" / "build.sh"
KARPENTER_INSTANCE_TYPES = REPO_ROOT / "hack" / "karpenter" / "instance-types.json"
VERSIONS_FILE = TESTENV_DIR / "versions.env"
DEFAULT_STATE_DIR = REPO_ROOT / ".kube-test"
STATE_FILE_NAME = "state.json"
KUBECONFIG_NAME = "kubeconfig"

SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
API_AUDIENCES = (SERVICE_ACCOUNT_ISSUER,)
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
"""
LOG_TAIL_LINES = 40

# The optional components, in start order (the scheduler and kwok need nothing from each other).
COMPONENTS = ("controller-manager", "scheduler", "kwok")
# Karpenter's kwok provider: started last, only when asked for by name (not by `--with all`), and only with
# kwok, which runs the nodes it creates. Its binary takes about 5 minutes to build cold.
KARPENTER = "karpenter"
KNOWN_COMPONENTS = (*COMPONENTS, KARPENTER)
# kwok manages only the nodes that carry this annotation (kwok's own convention), so tests can mix
# simulated nodes with bare Node objects that nothing heartbeats.
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
# The client identities the default RBAC policy knows (system:kube-scheduler, ...).
COMPONENT_USERS = {
    "controller-manager": "system:kube-controller-manager",
    "scheduler": "system:kube-scheduler",
}


class ControlPlaneError(RuntimeError):
    """Raised when the control plane cannot be built, started or reached."""


# --------------------------------------------------------------------------- versions


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """Parse versions.env (KEY=VALUE lines) so Python and build.sh share one pin."""
    versions: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        versions[key.strip()] = value.strip()
    for key in ("KUBE_VERSION", "ETCD_VERSION"):
        if key not in versions:
            raise ControlPlaneError(f"{key} missing from {path}")
    return versions


# The two supported ends the tests run: "newest" (KUBE_VERSION, ETCD_VERSION; every test) and "oldest"
# (KUBE_VERSION_OLDEST, ETCD_VERSION_OLDEST; a smoke subset). build.sh --oldest builds the latter.
NEWEST, OLDEST = "newest", "oldest"


def _suffix(release: str) -> str:
    if release not in (NEWEST, OLDEST):
        raise ControlPlaneError(f"unknown release {release!r}: {NEWEST} or {OLDEST}")
    return "_OLDEST" if release == OLDEST else ""


def kube_version(release: str = NEWEST) -> str:
    """The pinned Kubernetes release, e.g. ``v1.36.3``."""
    return read_versions()["KUBE_VERSION" + _suffix(release)]


def etcd_version(release: str = NEWEST) -> str:
    """The pinned etcd release, e.g. ``v3.6.8``."""
    return read_versions()["ETCD_VERSION" + _suffix(release)]


def cache_root() -> Path:
    """The per-user root of the pinned Go builds (same rule as hack/lib/gobuild.sh's gpuguard_cache_root)."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuguard"
    return Path(os.environ.get("GPUGUARD_CACHE") or default)


def cache_dir(release: str = NEWEST) -> Path:
    """Where build.sh puts the binaries for the pinned versions (same rule as hack/testenv/build.sh)."""
    root = Path(os.environ.get("GPUGUARD_TESTENV_CACHE") or cache_root() / "testenv")
    return root / f"{kube_version(release)}-{etcd_version(release)}"


@dataclass(frozen=True)
class Binaries:
    """Paths of the executables build.sh builds for one Kubernetes version: the newest has them all, the
    oldest only etcd and kube-apiserver."""

    etcd: Path
    kube_apiserver: Path
    kube_scheduler: Path | None = None
    kube_controller_manager: Path | None = None
    kubectl: Path | None = None

    def for_component(self, name: str) -> Path:
        """The binary of an optional component other than kwok."""
        path = {"scheduler": self.kube_scheduler, "controller-manager": self.kube_controller_manager}[name]
        if path is None:
            raise ControlPlaneError(f"{name} is built for the newest Kubernetes only")
        return path


def cached_binaries(release: str = NEWEST) -> Binaries | None:
    """The built binaries, or None when build.sh has not completed for these versions."""
    cache = cache_dir(release)
    bin_dir = cache / "bin"
    newest = release == NEWEST
    bins = Binaries(
        etcd=bin_dir / "etcd",
        kube_apiserver=bin_dir / "kube-apiserver",
        kube_scheduler=bin_dir / "kube-scheduler" if newest else None,
        kube_controller_manager=bin_dir / "kube-controller-manager" if newest else None,
        kubectl=bin_dir / "kubectl" if newest else None,
    )
    stamp = cache / ".complete"
    optional = (bins.kube_scheduler, bins.kube_controller_manager, bins.kubectl)
    paths = [bins.etcd, bins.kube_apiserver, *(p for p in optional if p is not None)]
    if stamp.is_file() and all(os.access(p, os.X_OK) for p in paths):
        return bins
    return None


def kwok_cached() -> Path | None:
    """The kwok controller hack/kwok/build.sh built for the pinned KWOK_VERSION, or None."""
    root = Path(os.environ.get("GPUGUARD_KWOK_CACHE") or cache_root() / "kwok")
    version = read_versions().get("KWOK_VERSION", "")
    path = root / version / "kwok"
    return path if version and os.access(path, os.X_OK) else None


def kwok_binary(*, allow_build: bool = True) -> Path:
    """The pinned kwok controller, built first by hack/kwok/build.sh when allowed (a few minutes cold)."""
    path = kwok_cached()
    if path is not None:
        return path
    if not allow_build:
        raise ControlPlaneError(f"kwok is not built; run: bash {KWOK_BUILD_SCRIPT.relative_to(REPO_ROOT)}")
    result = subprocess.run(["bash", str(KWOK_BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=False)
    path = kwok_cached()
    if result.returncode != 0 or path is None:
        raise ControlPlaneError(f"{KWOK_BUILD_SCRIPT} failed with exit code {result.returncode}")
    return path


def karpenter_cached() -> Path | None:
    """Karpenter's kwok provider hack/karpenter/build.sh built for the pinned KARPENTER_VERSION (with its
    CRDs in crds/ beside it), or None."""
    root = Path(os.environ.get("GPUGUARD_KARPENTER_CACHE") or cache_root() / "karpenter")
    version = read_versions().get("KARPENTER_VERSION", "")
    path = root / version / "karpenter-kwok"
    return path if version and os.access(path, os.X_OK) else None


def karpenter_binary(*, allow_build: bool = True) -> Path:
    """The pinned Karpenter kwok provider, built first by hack/karpenter/build.sh when allowed (about 5
    minutes cold on 2 cores)."""
    path = karpenter_cached()
    if path is not None:
        return path
    script = KARPENTER_BUILD_SCRIPT.relative_to(REPO_ROOT)
    if not allow_build:
        raise ControlPlaneError(f"Karpenter's kwok provider is not built; run: bash {script}")
    result = subprocess.run(
        ["bash", str(KARPENTER_BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=False
    )
    path = karpenter_cached()
    if result.returncode != 0 or path is None:
        raise ControlPlaneError(f"{KARPENTER_BUILD_SCRIPT} failed with exit code {result.returncode}")
    return path


def build(*, quiet: bool = False, release: str = NEWEST) -> Binaries:
    """Run build.sh (instant when cached; several minutes cold) and return the paths.

    Its progress goes to stderr (fd 2) so that `up` keeps stdout for the kubeconfig path.
    """
    out = subprocess.DEVNULL if quiet else 2
    args = ["--oldest"] if release == OLDEST else []
    result = subprocess.run(["bash", str(BUILD_SCRIPT), *args], stdout=out, check=False)
    if result.returncode != 0:
        raise ControlPlaneError(f"{BUILD_SCRIPT} failed with exit code {result.returncode}")
    bins = cached_binaries(release)
    if bins is None:
        raise ControlPlaneError(f"{BUILD_SCRIPT} succeeded but {cache_dir(release)} is incomplete")
    return bins


def ensure_binaries(*, allow_build: bool = True, release: str = NEWEST) -> Binaries:
    """Return the binaries, building them first when allowed; fail clearly otherwise."""
    bins = cached_binaries(release)
    if bins is not None:
        return bins
    if not allow_build:
        flag = " --oldest" if release == OLDEST else ""
        raise ControlPlaneError(
            f"kube-apiserver/etcd for {kube_version(release)}/{etcd_version(release)} are not built; "
            f"run: bash {BUILD_SCRIPT.relative_to(REPO_ROOT)}{flag}"
        )
    return build(release=release)


# --------------------------------------------------------------------------- PKI


@dataclass(frozen=True)
class _KeyPair:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


def _new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: fast to generate, and accepted by kube-apiserver for TLS and SA tokens.
    return ec.generate_private_key(ec.SECP256R1())


def _cert(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: _KeyPair | None,
    *,
    ca: bool = False,
    usages: list[x509.ObjectIdentifier] | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> _KeyPair:
    now = datetime.datetime.now(datetime.UTC)
    signer_key = issuer.key if issuer else key
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.cert.subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if issuer is not None:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()),
            critical=False,
        )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return _KeyPair(key=key, cert=builder.sign(signer_key, hashes.SHA256()))


def _name(common_name: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@dataclass(frozen=True)
class Pki:
    """File paths of the generated CA, serving, admin-client and SA-signing material."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_public_key: Path
    sa_signing_key: Path


def generate_pki(directory: Path) -> Pki:
    """Create a fresh CA and the certs/keys kube-apiserver and an admin client need."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _cert(_name("gpuguard-test-ca"), _new_key(), None, ca=True)
    serving = _cert(
        _name("kube-apiserver"),
        _new_key(),
        ca,
        usages=[ExtendedKeyUsageOID.SERVER_AUTH],
        sans=[
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            # The `kubernetes` Service IP: first host of the service range.
            x509.IPAddress(ipaddress.IPv4Network(SERVICE_CLUSTER_IP_RANGE)[1]),
            x509.DNSName("localhost"),
            x509.DNSName("kubernetes"),
            x509.DNSName("kubernetes.default"),
            x509.DNSName("kubernetes.default.svc"),
            x509.DNSName("kubernetes.default.svc.cluster.local"),
        ],
    )
    # O=system:masters is bound to cluster-admin by the default RBAC policy.
    admin = _cert(
        _name("admin", "system:masters"),
        _new_key(),
        ca,
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    sa_key = _new_key()
    pki = Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        sa_public_key=directory / "sa.pub",
        sa_signing_key=directory / "sa.key",
    )
    pki.ca_cert.write_bytes(_pem_cert(ca.cert))
    _write_private(pki.ca_key, _pem_key(ca.key))
    pki.serving_cert.write_bytes(_pem_cert(serving.cert))
    _write_private(pki.serving_key, _pem_key(serving.key))
    pki.admin_cert.write_bytes(_pem_cert(admin.cert))
    _write_private(pki.admin_key, _pem_key(admin.key))
    pki.sa_public_key.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    _write_private(pki.sa_signing_key, _pem_key(sa_key))
    return pki


def generate_client_cert(pki: Pki, user: str, stem: Path) -> tuple[Path, Path]:
    """A client certificate for user (CN), signed by pki's CA: stem.crt and stem.key."""
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ControlPlaneError(f"{pki.ca_key} is not an EC key")
    ca = _KeyPair(key=ca_key, cert=x509.load_pem_x509_certificate(pki.ca_cert.read_bytes()))
    pair = _cert(_name(user), _new_key(), ca, usages=[ExtendedKeyUsageOID.CLIENT_AUTH])
    cert, key = stem.with_suffix(".crt"), stem.with_suffix(".key")
    cert.write_bytes(_pem_cert(pair.cert))
    _write_private(key, _pem_key(pair.key))
    return cert, key


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (races are retried by start())."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _pid_alive(pid: int) -> bool:
    """True if pid runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _pid_runs(pid: int, exe: str) -> bool:
    """True if pid is alive and still runs exe (guards against pid reuse after a reboot)."""
    if not _pid_alive(pid):
        return False
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return argv0 == exe


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class State:
    """What `down` in another process needs: pids, ports and directories."""

    work_dir: str
    state_dir: str
    etcd_bin: str
    apiserver_bin: str
    etcd_client_port: int
    etcd_peer_port: int
    apiserver_port: int
    etcd_pid: int | None = None
    apiserver_pid: int | None = None
    kube_version: str = ""
    etcd_version: str = ""
    started_at: float = field(default_factory=time.time)
    # The optional components: name -> {"bin": path, "pid": pid or None, "port": serving port}.
    components: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> State | None:
        """Read state.json; None if absent or unreadable (treated as 'not running')."""
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None

    def save(self, path: Path) -> None:
        """Write atomically so a concurrent reader never sees half a file."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)


class ControlPlane:
    """etcd + kube-apiserver processes plus the files (PKI, kubeconfig, audit log) around them.

    All paths derive from ``state_dir`` (kubeconfig, state.json) and a temporary
    ``work_dir`` (PKI, etcd data, logs, audit log) that stop() removes.
    """

    def __init__(
        self,
        state_dir: Path = DEFAULT_STATE_DIR,
        *,
        allow_build: bool = True,
        ready_timeout: float = 90.0,
        die_with_parent: bool = False,
        release: str = NEWEST,
        components: tuple[str, ...] = (),
        runtime_config: str = "",
    ) -> None:
        """die_with_parent: have the kernel SIGKILL the servers when this process dies, so
        a test run killed hard (no teardown) leaves no server running (the work dir in /tmp
        stays). `up` must not use it: its servers outlive it. components: any of KNOWN_COMPONENTS,
        started after kube-apiserver and stopped before it. runtime_config: kube-apiserver's
        --runtime-config (API versions and resources served or not beyond the defaults), e.g. to
        serve an API only in an older version as an older release would."""
        self.components = parse_components(",".join(components))
        self.runtime_config = runtime_config
        self.state_dir = Path(state_dir)
        self.allow_build = allow_build
        self.ready_timeout = ready_timeout
        self.die_with_parent = die_with_parent
        self.release = release
        self.state: State | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # ---- paths and URLs

    @property
    def state_path(self) -> Path:
        """state.json, read by `down`/`status` and by test-session reuse."""
        return self.state_dir / STATE_FILE_NAME

    @property
    def kubeconfig_path(self) -> Path:
        """Admin kubeconfig (client cert data embedded)."""
        return self.state_dir / KUBECONFIG_NAME

    def _require_state(self) -> State:
        if self.state is None:
            raise ControlPlaneError("control plane not started")
        return self.state

    @property
    def work_dir(self) -> Path:
        """Temporary directory with PKI, etcd data, logs and the audit log."""
        return Path(self._require_state().work_dir)

    @property
    def url(self) -> str:
        """https URL of kube-apiserver."""
        return f"https://127.0.0.1:{self._require_state().apiserver_port}"

    @property
    def etcd_url(self) -> str:
        """Plain-http client URL of etcd (loopback only)."""
        return f"http://127.0.0.1:{self._require_state().etcd_client_port}"

    @property
    def pki_dir(self) -> Path:
        """Directory with the generated certificates and keys."""
        return self.work_dir / "pki"

    @property
    def ca_path(self) -> Path:
        """CA that signed the serving and admin certificates."""
        return self.pki_dir / "ca.crt"

    @property
    def audit_log_path(self) -> Path:
        """JSON-lines audit log (level Metadata for every request, written blocking)."""
        return self.work_dir / "audit.log"

    @property
    def apiserver_log_path(self) -> Path:
        """stdout/stderr of kube-apiserver."""
        return self.work_dir / "kube-apiserver.log"

    @property
    def etcd_log_path(self) -> Path:
        """stdout/stderr of etcd."""
        return self.work_dir / "etcd.log"

    def log_path(self, name: str) -> Path:
        """stdout/stderr of a process: etcd, kube-apiserver or one of KNOWN_COMPONENTS."""
        return self.work_dir / f"{name}.log"

    # ---- lifecycle

    @classmethod
    def attach(cls, state_dir: Path = DEFAULT_STATE_DIR) -> ControlPlane | None:
        """A handle on a control plane another process started, if it is alive and ready."""
        cp = cls(state_dir)
        state = State.load(cp.state_path)
        if state is None:
            return None
        cp.state = state
        if not cp.is_running() or not cp.is_ready():
            return None
        return cp

    def start(self) -> None:
        """Build if needed, then start etcd and kube-apiserver and write the kubeconfig.

        On any failure everything started so far is stopped and removed again.
        """
        if self.state is not None:
            raise ControlPlaneError("already started")
        if ControlPlane.attach(self.state_dir) is not None:
            raise ControlPlaneError(
                f"{self.state_path} describes a running control plane; reuse it with "
                "ControlPlane.attach() or stop it with `python -m harness.controlplane down` (make kube-down)"
            )
        # A stale state.json may still name a live etcd (e.g. the apiserver crashed).
        ControlPlane.stop_recorded(self.state_dir)
        bins = ensure_binaries(allow_build=self.allow_build, release=self.release)
        built = {
            "kwok": lambda: kwok_binary(allow_build=self.allow_build),
            KARPENTER: lambda: karpenter_binary(allow_build=self.allow_build),
        }
        component_bins = {
            name: built[name]() if name in built else bins.for_component(name) for name in self.components
        }
        self.state_dir.mkdir(parents=True, exist_ok=True)
        work_dir = Path(tempfile.mkdtemp(prefix="gpuguard-kube-"))
        versions = read_versions()
        self.state = State(
            work_dir=str(work_dir),
            state_dir=str(self.state_dir),
            etcd_bin=str(bins.etcd),
            apiserver_bin=str(bins.kube_apiserver),
            etcd_client_port=0,
            etcd_peer_port=0,
            apiserver_port=0,
            kube_version=versions["KUBE_VERSION" + _suffix(self.release)],
            etcd_version=versions["ETCD_VERSION" + _suffix(self.release)],
            components={
                name: {"bin": str(path), "pid": None, "port": 0} for name, path in component_bins.items()
            },
        )
        try:
            pki = generate_pki(self.pki_dir)
            (work_dir / "audit-policy.yaml").write_text(AUDIT_POLICY)
            self._start_etcd_with_retry()
            self._start_apiserver_with_retry()
            self.write_kubeconfig()
            for name in self.components:
                if name in COMPONENT_USERS:
                    cert, key = generate_client_cert(pki, COMPONENT_USERS[name], self.pki_dir / name)
                    self.write_kubeconfig(self.component_kubeconfig(name), cert=cert, key=key)
                if name == KARPENTER:
                    self._apply_karpenter_crds(bins)
                self._start_component_with_retry(name)
        except BaseException:
            self.stop()
            raise

    @classmethod
    def stop_recorded(cls, state_dir: Path = DEFAULT_STATE_DIR) -> bool:
        """Stop whatever state.json in state_dir describes, alive or not; False if nothing."""
        cp = cls(state_dir)
        state = State.load(cp.state_path)
        if state is None:
            return False
        cp.state = state
        cp.stop()
        return True

    def stop(self) -> None:
        """Stop both processes and delete the work dir, kubeconfig and state; idempotent."""
        state = self.state
        if state is None:
            return
        for name in reversed(list(state.components)):
            self.stop_component(name)
        self.stop_apiserver()
        self._stop_process("etcd", state.etcd_pid, state.etcd_bin)
        state.etcd_pid = None
        shutil.rmtree(state.work_dir, ignore_errors=True)
        if self._state_file_is_ours_or_absent():
            for path in (self.state_path, self.kubeconfig_path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        self.state = None

    def stop_apiserver(self) -> None:
        """Stop kube-apiserver only (etcd and all files stay), e.g. for an outage test."""
        state = self._require_state()
        self._stop_process("kube-apiserver", state.apiserver_pid, state.apiserver_bin)
        state.apiserver_pid = None
        self._save_state()

    def stop_component(self, name: str) -> None:
        """Stop one of the optional components (the rest keeps running)."""
        state = self._require_state()
        comp = state.components[name]
        self._stop_process(name, comp["pid"], comp["bin"])
        comp["pid"] = None
        self._save_state()

    def component_kubeconfig(self, name: str) -> Path:
        """The kubeconfig a component runs with (kwok and Karpenter: the admin's)."""
        if name not in COMPONENT_USERS:
            return self.kubeconfig_path
        return self.work_dir / f"{name}.kubeconfig"

    def start_apiserver(self) -> None:
        """(Re)start kube-apiserver with the same flags, port and certificates; wait ready."""
        state = self._require_state()
        if state.apiserver_pid is not None and _pid_runs(state.apiserver_pid, state.apiserver_bin):
            raise ControlPlaneError(f"kube-apiserver already runs (pid {state.apiserver_pid})")
        self._spawn("kube-apiserver", self._apiserver_args(), self.apiserver_log_path)
        self.wait_ready()

    def is_running(self) -> bool:
        """All processes alive (says nothing about readiness)."""
        state = self.state
        if state is None or state.etcd_pid is None or state.apiserver_pid is None:
            return False
        components_up = all(
            c["pid"] is not None and _pid_runs(c["pid"], c["bin"]) for c in state.components.values()
        )
        return (
            components_up
            and _pid_runs(state.etcd_pid, state.etcd_bin)
            and _pid_runs(state.apiserver_pid, state.apiserver_bin)
        )

    def is_ready(self) -> bool:
        """GET /readyz answers 200."""
        try:
            status, _ = self.get("/readyz", timeout=5)
        except (OSError, ControlPlaneError):
            return False
        return status == 200

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until /readyz is 200; on timeout raise with the tail of the apiserver log."""
        state = self._require_state()

        def probe() -> str | None:
            status, body = self.get("/readyz?verbose", timeout=5)
            if status == 200:
                return None
            return f"HTTP {status}: " + " | ".join(line for line in body.splitlines() if "failed" in line)

        self._wait_until(
            "kube-apiserver",
            lambda: state.apiserver_pid,
            probe,
            timeout=self.ready_timeout if timeout is None else timeout,
            where=f"ready at {self.url}",
            interval=0.25,
        )

    def _wait_until(
        self,
        name: str,
        pid: Callable[[], int | None],
        probe: Callable[[], str | None],
        *,
        timeout: float,
        where: str,
        interval: float = 0.1,
    ) -> None:
        """Poll probe (None: up; otherwise why not, OSError too) until it answers None; raise with the tail of
        the process's log when the process exits or the timeout passes."""
        log = self.log_path(name)
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            current = pid()
            if current is None or not _pid_alive(current):
                raise ControlPlaneError(f"{name} exited during startup; last lines of {log}:\n{_tail(log)}")
            try:
                answer = probe()
            except OSError as e:
                answer = str(e)
            if answer is None:
                return
            last = answer
            time.sleep(interval)
        raise ControlPlaneError(
            f"{name} not {where} after {timeout:.0f}s ({last}); last lines of {log}:\n{_tail(log)}"
        )

    # ---- requests and files for tests

    def ssl_context(self) -> ssl.SSLContext:
        """TLS context trusting the test CA and presenting the admin client cert."""
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        ctx.load_cert_chain(str(self.pki_dir / "admin.crt"), str(self.pki_dir / "admin.key"))
        return ctx

    def get(self, path: str, *, timeout: float = 10) -> tuple[int, str]:
        """GET path as admin; returns (status, body) even for HTTP errors."""
        req = urllib.request.Request(self.url + path, headers={"User-Agent": "gpuguard-testenv"})
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.ssl_context()) as r:
                return int(r.status), r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return int(e.code), e.read().decode(errors="replace")

    def version(self) -> dict[str, Any]:
        """The parsed /version document."""
        status, body = self.get("/version")
        if status != 200:
            raise ControlPlaneError(f"/version answered HTTP {status}: {body}")
        doc: dict[str, Any] = json.loads(body)
        return doc

    def write_kubeconfig(
        self, path: Path | None = None, *, cert: Path | None = None, key: Path | None = None
    ) -> Path:
        """Write a kubeconfig (data embedded, so it survives copying) and return it: the admin's by
        default, or one for the client certificate cert/key at path."""
        path = path or self.kubeconfig_path
        cert = cert or self.pki_dir / "admin.crt"
        key = key or self.pki_dir / "admin.key"

        def b64(path: Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        text = f"""\
apiVersion: v1
kind: Config
clusters:
  - name: gpuguard-test
    cluster:
      server: {self.url}
      certificate-authority-data: {b64(self.ca_path)}
users:
  - name: admin
    user:
      client-certificate-data: {b64(cert)}
      client-key-data: {b64(key)}
contexts:
  - name: gpuguard-test
    context:
      cluster: gpuguard-test
      user: admin
current-context: gpuguard-test
"""
        tmp = path.with_suffix(".tmp")
        _write_private(tmp, text.encode())
        tmp.replace(path)
        return path

    def audit_line_count(self) -> int:
        """Number of lines in the audit log now; pass as since_line to see only newer ones."""
        try:
            with self.audit_log_path.open("rb") as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    def audit_events(
        self,
        user_agent_prefix: str | None = None,
        since_line: int | None = None,
        *,
        stage: str | None = None,
    ) -> list[dict[str, Any]]:
        """Parsed audit events (one JSON object per line), optionally filtered.

        Why: apiserver_request_total has no user-agent label, so tests count a client's
        requests here. Most requests log one ResponseComplete event; watches and other
        long-running requests also log ResponseStarted, so pass stage="ResponseComplete"
        to count each request once. A torn last line (write in progress) is skipped.
        """
        events: list[dict[str, Any]] = []
        try:
            with self.audit_log_path.open(encoding="utf-8", errors="replace") as f:
                for index, line in enumerate(f):
                    if since_line is not None and index < since_line:
                        continue
                    try:
                        event = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if stage is not None and event.get("stage") != stage:
                        continue
                    agent = str(event.get("userAgent", ""))
                    if user_agent_prefix is not None and not agent.startswith(user_agent_prefix):
                        continue
                    events.append(event)
        except FileNotFoundError:
            pass
        return events

    # ---- internals

    def _state_file_is_ours_or_absent(self) -> bool:
        """Never touch a state.json/kubeconfig that describes another control plane."""
        on_disk = State.load(self.state_path)
        return on_disk is None or (self.state is not None and on_disk.work_dir == self.state.work_dir)

    def _save_state(self) -> None:
        if self.state is not None and self._state_file_is_ours_or_absent():
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self.state.save(self.state_path)

    def _spawn(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        state = self._require_state()
        setpriv = shutil.which("setpriv")
        if self.die_with_parent and setpriv:
            # util-linux setpriv sets PR_SET_PDEATHSIG and execs the server (same pid,
            # same argv[0]); no preexec_fn, which is unsafe in threaded processes. KILL,
            # not TERM: a TERMed apiserver waits forever for the etcd dying beside it.
            args = [setpriv, "--pdeathsig=KILL", "--", *args]
        with log_path.open("ab") as log:
            log.write(f"\n==== {time.strftime('%F %T')} starting {name}\n".encode())
            log.flush()
            # Own session = own process group, so stop() can signal the whole group and
            # Ctrl-C in a terminal running `up` does not reach the servers.
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=state.work_dir,
                env={**os.environ, **env} if env else None,
            )
        self._procs[name] = proc
        if name == "etcd":
            state.etcd_pid = proc.pid
        elif name == "kube-apiserver":
            state.apiserver_pid = proc.pid
        else:
            state.components[name]["pid"] = proc.pid
        self._save_state()

    def _stop_process(self, name: str, pid: int | None, exe: str, grace: float = 15.0) -> None:
        proc = self._procs.pop(name, None)
        # Our own child is judged by Popen (its argv[0] may still be setpriv's); a server
        # another process started, by pid and argv[0] (a reused pid is left alone).
        alive = proc.poll() is None if proc is not None else pid is not None and _pid_runs(pid, exe)
        if pid is None or not alive:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                break
            if proc is None and not _pid_alive(pid):
                break
            time.sleep(0.05)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        if proc is not None:
            proc.wait()
            return
        while _pid_alive(pid):
            time.sleep(0.05)
        # Not our child: init reaps the zombie, lazily. Wait briefly so that `pgrep` right
        # after `down` shows nothing.
        deadline = time.monotonic() + 5.0
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _etcd_args(self) -> list[str]:
        s = self._require_state()
        peer = f"http://127.0.0.1:{s.etcd_peer_port}"
        client = f"http://127.0.0.1:{s.etcd_client_port}"
        return [
            s.etcd_bin,
            "--name=gpuguard-test",
            f"--data-dir={Path(s.work_dir) / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=gpuguard-test={peer}",
            "--initial-cluster-state=new",
            # Test data is disposable: skip fsync, it dominates latency on slow disks.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]

    def _apiserver_args(self) -> list[str]:
        s = self._require_state()
        pki = self.pki_dir
        return [
            s.apiserver_bin,
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={s.apiserver_port}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--api-audiences={','.join(API_AUDIENCES)}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            f"--audit-policy-file={Path(s.work_dir) / 'audit-policy.yaml'}",
            f"--audit-log-path={self.audit_log_path}",
            "--audit-log-format=json",
            # blocking: each event is written before the response, so tests can read it.
            "--audit-log-mode=blocking",
            "--audit-log-maxsize=0",
            "--allow-privileged=true",
            # The Endpoints of the `kubernetes` Service may not be loopback; nothing here
            # needs them, and reconciling them would log errors forever.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=1",
            *([f"--runtime-config={self.runtime_config}"] if self.runtime_config else []),
        ]

    def _component_args(self, name: str) -> list[str]:
        s = self._require_state()
        comp = s.components[name]
        kubeconfig = str(self.component_kubeconfig(name))
        if name == KARPENTER:
            return [comp["bin"]]  # configured by environment: _component_env
        if name == "kwok":
            return [
                comp["bin"],
                f"--kubeconfig={kubeconfig}",
                f"--config={KWOK_STAGES}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=" + "=".join(KWOK_NODE_ANNOTATION),
                "--node-lease-duration-seconds=40",
                "--cidr=10.244.0.0/16",
                "--node-ip=127.0.0.1",
                f"--server-address=127.0.0.1:{comp['port']}",
            ]
        common = [
            comp["bin"],
            f"--kubeconfig={kubeconfig}",
            # Delegated authn/authz of the component's own /metrics etc.; /healthz is always allowed.
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={comp['port']}",
            # A self-signed serving certificate, written here.
            f"--cert-dir={Path(s.work_dir) / name}",
            "--leader-elect=false",
            "--profiling=false",
            "--v=1",
        ]
        if name == "scheduler":
            return common
        pki = self.pki_dir
        return [
            *common,
            # Every default controller: service-account tokens, taint eviction (NoExecute), node life
            # cycle, Deployments/ReplicaSets, DaemonSets, garbage collection, ...
            "--controllers=*",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        ]

    def _component_env(self, name: str) -> dict[str, str] | None:
        """Karpenter reads its settings from the environment (each also has a flag) and its client
        configuration from KUBECONFIG; the other components take flags only."""
        if name != KARPENTER:
            return None
        comp = self._require_state().components[name]
        return {
            "KUBECONFIG": str(self.component_kubeconfig(name)),
            # The health probe port is the component's port (/healthz); metrics get a port of their own.
            "HEALTH_PROBE_PORT": str(comp["port"]),
            "METRICS_PORT": str(free_port()),
            # One replica: no lease to win first.
            "DISABLE_LEADER_ELECTION": "true",
            "INSTANCE_TYPES_FILE_PATH": str(KARPENTER_INSTANCE_TYPES),
            "LOG_LEVEL": "debug",
        }

    def _apply_karpenter_crds(self, bins: Binaries) -> None:
        """Karpenter's CRDs (NodePool, NodeClaim, NodeOverlay, KWOKNodeClass, CapacityBuffer; copied beside
        its binary by hack/karpenter/build.sh), applied with kubectl and Established before it starts."""
        crds = Path(self._require_state().components[KARPENTER]["bin"]).parent / "crds"
        if bins.kubectl is None or not crds.is_dir():
            raise ControlPlaneError(f"Karpenter's CRDs need kubectl and {crds}")
        base = [str(bins.kubectl), f"--kubeconfig={self.kubeconfig_path}"]
        for args in (
            ["apply", "--server-side", "-f", str(crds)],
            ["wait", "--for=condition=Established", "--timeout=60s", "-f", str(crds)],
        ):
            result = subprocess.run(
                [*base, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
            )
            if result.returncode != 0:
                raise ControlPlaneError(f"kubectl {args[0]} of Karpenter's CRDs failed:\n{result.stdout}")

    def _component_health_url(self, name: str) -> str:
        port = self._require_state().components[name]["port"]
        scheme = "http" if name in ("kwok", KARPENTER) else "https"
        return f"{scheme}://127.0.0.1:{port}/healthz"

    def _wait_component(self, name: str, timeout: float = 60.0) -> None:
        """Block until the component's /healthz answers 200 (its serving certificate is self-signed)."""
        comp = self._require_state().components[name]
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        url = self._component_health_url(name)

        def probe() -> str | None:
            try:
                with urllib.request.urlopen(url, timeout=2, context=insecure) as r:
                    return None if r.status == 200 else f"HTTP {r.status}"
            except urllib.error.HTTPError as e:
                return f"HTTP {e.code}"

        self._wait_until(name, lambda: comp["pid"], probe, timeout=timeout, where=f"healthy at {url}")

    def _start_component_with_retry(self, name: str, attempts: int = 3) -> None:
        comp = self._require_state().components[name]
        for attempt in range(1, attempts + 1):
            comp["port"] = free_port()
            self._spawn(name, self._component_args(name), self.log_path(name), self._component_env(name))
            try:
                self._wait_component(name)
                return
            except ControlPlaneError:
                self.stop_component(name)
                if attempt == attempts or "address already in use" not in _tail(self.log_path(name)):
                    raise

    def _wait_etcd(self, timeout: float = 30.0) -> None:
        state = self._require_state()

        def probe() -> str | None:
            try:
                with urllib.request.urlopen(self.etcd_url + "/health", timeout=2) as r:
                    return None if json.loads(r.read()).get("health") == "true" else "not healthy"
            except ValueError as e:
                return str(e)

        self._wait_until(
            "etcd", lambda: state.etcd_pid, probe, timeout=timeout, where=f"healthy at {self.etcd_url}"
        )

    def _start_etcd_with_retry(self, attempts: int = 3) -> None:
        state = self._require_state()
        for attempt in range(1, attempts + 1):
            state.etcd_client_port, state.etcd_peer_port = free_port(), free_port()
            self._spawn("etcd", self._etcd_args(), self.etcd_log_path)
            try:
                self._wait_etcd()
                return
            except ControlPlaneError:
                self._stop_process("etcd", state.etcd_pid, state.etcd_bin)
                state.etcd_pid = None
                shutil.rmtree(Path(state.work_dir) / "etcd", ignore_errors=True)
                if attempt == attempts or "address already in use" not in _tail(self.etcd_log_path):
                    raise

    def _start_apiserver_with_retry(self, attempts: int = 3) -> None:
        state = self._require_state()
        for attempt in range(1, attempts + 1):
            state.apiserver_port = free_port()
            self._spawn("kube-apiserver", self._apiserver_args(), self.apiserver_log_path)
            try:
                self.wait_ready()
                return
            except ControlPlaneError:
                self.stop_apiserver()
                if attempt == attempts or "address already in use" not in _tail(self.apiserver_log_path):
                    raise


# --------------------------------------------------------------------------- CLI


@contextlib.contextmanager
def _state_lock(state_dir: Path) -> Iterator[None]:
    """Serialise up/down/status on one state dir (e.g. two `make kube-up` at once)."""
    import fcntl

    state_dir.mkdir(parents=True, exist_ok=True)
    with (state_dir / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cmd_up(state_dir: Path, *, allow_build: bool, components: tuple[str, ...] = ()) -> int:
    """Start (or find running) a control plane and print the kubeconfig path."""
    with _state_lock(state_dir):
        running = ControlPlane.attach(state_dir)
        if running is not None:
            print(f"control plane already up at {running.url}", file=sys.stderr)
            print(running.kubeconfig_path)
            return 0
        cp = ControlPlane(state_dir, allow_build=allow_build, components=components)
        cp.start()
        version = cp.version().get("gitVersion", "?")
        print(f"kube-apiserver {version} ready at {cp.url}", file=sys.stderr)
        print(f"audit log: {cp.audit_log_path}", file=sys.stderr)
        print(f"export KUBECONFIG={cp.kubeconfig_path}", file=sys.stderr)
        print(cp.kubeconfig_path)
        return 0


def cmd_down(state_dir: Path) -> int:
    """Stop the control plane described by state.json; fine if there is none."""
    with _state_lock(state_dir):
        if ControlPlane.stop_recorded(state_dir):
            print("control plane stopped", file=sys.stderr)
        else:
            print("control plane not running", file=sys.stderr)
        with contextlib.suppress(FileNotFoundError):
            (state_dir / KUBECONFIG_NAME).unlink()
        return 0


def cmd_status(state_dir: Path) -> int:
    """Print what runs; exit 0 only when both processes run and /readyz is 200."""
    cp = ControlPlane(state_dir)
    state = State.load(cp.state_path)
    if state is None:
        print("down (no state)")
        return 3
    cp.state = state
    etcd_up = state.etcd_pid is not None and _pid_runs(state.etcd_pid, state.etcd_bin)
    api_up = state.apiserver_pid is not None and _pid_runs(state.apiserver_pid, state.apiserver_bin)
    comps_up = {
        name: c["pid"] is not None and _pid_runs(c["pid"], c["bin"]) for name, c in state.components.items()
    }
    running = etcd_up and api_up and all(comps_up.values())
    ready = api_up and cp.is_ready()
    verdict = "up" if running and ready else "degraded" if etcd_up or api_up else "down"
    print(f"{verdict}: {cp.url}")
    print(f"  {'etcd':<18} pid {state.etcd_pid} running={etcd_up} {cp.etcd_url}")
    print(f"  {'kube-apiserver':<18} pid {state.apiserver_pid} running={api_up} ready={ready}")
    for name, comp in state.components.items():
        print(f"  {name:<18} pid {comp['pid']} running={comps_up[name]} port {comp['port']}")
    print(f"  {'kubeconfig':<22} {cp.kubeconfig_path}")
    print(f"  {'audit log':<22} {cp.audit_log_path}")
    return 0 if running and ready else 1


def parse_components(text: str) -> tuple[str, ...]:
    """`--with`'s comma-separated list: "all" stands for COMPONENTS (not Karpenter, which is asked for by
    name: "all,karpenter"); the names are checked (ControlPlaneError) and put in start order."""
    wanted = [c.strip() for c in text.split(",") if c.strip()]
    names = {c for w in wanted for c in (COMPONENTS if w == "all" else (w,))}
    unknown = names - set(KNOWN_COMPONENTS)
    if unknown:
        raise ControlPlaneError(f"unknown components {sorted(unknown)}; known: {', '.join(KNOWN_COMPONENTS)}")
    if KARPENTER in names and "kwok" not in names:
        raise ControlPlaneError("karpenter needs kwok, which runs the nodes it creates")
    return tuple(c for c in KNOWN_COMPONENTS if c in names)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: up | down | status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help=f"where kubeconfig and state.json live (default {DEFAULT_STATE_DIR})",
    )
    parser.add_argument(
        "--no-build",
        action="store_true",
        help="fail instead of running build.sh when the binaries are missing",
    )
    parser.add_argument(
        "--with",
        dest="components",
        default="",
        help=f"up: also start these, comma-separated ({','.join(KNOWN_COMPONENTS)}, or 'all' for "
        f"{','.join(COMPONENTS)})",
    )
    args = parser.parse_args(argv)
    try:
        components = parse_components(args.components)
        if args.command == "up":
            return cmd_up(args.state_dir, allow_build=not args.no_build, components=components)
        if args.command == "down":
            return cmd_down(args.state_dir)
        return cmd_status(args.state_dir)
    except ControlPlaneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
