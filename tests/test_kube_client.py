"""gpuguard's own Kubernetes client: the config loaders and the HTTP exchange (TLS against the real API server
is in tests/integration: every agent there talks through this client)."""

from __future__ import annotations

import base64
import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar

import pytest
import urllib3.util.connection
import yaml

from gpuguard.core.config import QuarantineLimit
from gpuguard.core.errors import ConfigError, ConflictError, PermanentApiError, TransientApiError
from gpuguard.core.validation import MAX_EVENT_MESSAGE_BYTES
from gpuguard.kube import client as kubeclient
from gpuguard.kube import kubeconfig
from gpuguard.kube import kubeconfig as kc
from gpuguard.kube.events import NODE_NAMESPACE
from gpuguard.quarantine.budget import Budget
from gpuguard.quarantine.node.view import EventSpec, NodeView
from gpuguard.quarantine.node.writers import KubeNodeWriter
from harness.fakes import http_server, self_signed_pem

ROOT = Path(__file__).resolve().parents[1]


def write_kubeconfig(tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster or {"server": "https://10.0.0.1:6443"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "ns"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


_WELL_FORMED = (
    "current-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
    "clusters: [{name: c, cluster: {server: 'https://k'}}]\nusers: [{name: u, user: {token: abc}}]\n"
)


# -- loaders -----------------------------------------------------------------------------------------------


def test_a_token_kubeconfig_with_a_relative_ca_path_is_read_without_the_kubernetes_package(
    tmp_path: Path,
) -> None:
    path = write_kubeconfig(
        tmp_path, {"token": "abc"}, {"server": "https://k:6443", "certificate-authority": "ca.pem"}
    )
    (tmp_path / "ca.pem").write_bytes(self_signed_pem()[0])
    creds = kc.from_kubeconfig(str(path))
    assert creds.server == "https://k:6443" and creds.token == "abc"
    assert creds.ca_file == str(tmp_path.resolve() / "ca.pem")  # relative to the kubeconfig, as kubectl does
    assert creds.authorization is None and not creds.insecure


def test_embedded_certificates_become_private_files(tmp_path: Path) -> None:
    ca, (cert, key) = self_signed_pem("ca")[0], self_signed_pem("client")
    pems = {"ca": ca, "cert": cert, "key": key}
    data = {k: base64.b64encode(v).decode() for k, v in pems.items()}
    path = write_kubeconfig(
        tmp_path,
        {"client-certificate-data": data["cert"], "client-key-data": data["key"]},
        {"server": "https://k", "certificate-authority-data": data["ca"]},
    )
    creds = kc.from_kubeconfig(str(path))
    assert creds.ca_file and creds.cert_file and creds.key_file
    assert Path(creds.key_file).read_bytes() == key and Path(creds.cert_file).read_bytes() == cert
    assert Path(creds.ca_file).read_bytes() == ca
    assert stat.S_IMODE(os.stat(creds.key_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(Path(creds.key_file).parent).st_mode) == 0o700


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no mapping"),
        ("[1, 2", "kubeconfig"),
        ("apiVersion: v1\n", "no current-context"),
        ("current-context: x\ncontexts: []\n", "no context named 'x'"),
        (
            "current-context: x\ncontexts: [{name: x, context: {cluster: c, user: u}}]\nclusters: []\n",
            "no cluster named 'c'",
        ),
        (
            "current-context: x\ncontexts: [{name: x, context: {cluster: c}}]\n"
            "clusters: [{name: c, cluster: {}}]\n",
            "has no server",
        ),
        (
            "current-context: x\ncontexts: [{name: x, context: {cluster: c}}]\n"
            "clusters: [{name: c, cluster: {server: 'https://k', certificate-authority-data: '!!'}}]\n",
            "not base64",
        ),
        ("\xff\xfe", "not UTF-8 text"),
        ("[1, 2", r"not valid YAML at line 1, column 6: expected ',' or '\]'"),
        ("current-context: [x]\n", "current-context must be a name"),
        ("current-context: x\ncontexts: 5\n", "contexts must be a list"),
        ("current-context: x\ncontexts: [{name: x, context: [c]}]\n", "context 'x' must be a mapping"),
        ("current-context: x\ncontexts: [{name: x, context: {cluster: [c]}}]\n", "cluster must be a name"),
        (_WELL_FORMED.replace("token: abc", "tokenFile: 5"), "tokenFile must be a string"),
        (_WELL_FORMED.replace("token: abc", "token: [abc]"), "token must be a string"),
        (_WELL_FORMED.replace("token: abc", 'token: "a\\nb"'), "token: not a bearer token"),
        (
            _WELL_FORMED.replace("token: abc", "tokenFile: /dev/zero"),
            "tokenFile /dev/zero: not a regular file",
        ),
        (
            _WELL_FORMED.replace("server:", "insecure-skip-tls-verify: 'false', server:"),
            "must be true or false",
        ),
        (_WELL_FORMED.replace("server:", "certificate-authority: /nope, server:"), "/nope: no such file"),
        (_WELL_FORMED.replace("server:", "certificate-authority-data: [1], server:"), "must be a string"),
        ("a: " + "[" * 100_000, "nested too deeply|not valid YAML"),
        ("users: !!python/object:os.system ls\n", "not valid YAML"),
        ("x: 2001-02-30\n", "a value YAML cannot build"),
    ],
)
def test_a_broken_kubeconfig_is_one_clear_config_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "kubeconfig"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError, match=message) as err:
        kc.from_kubeconfig(str(path))
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_kubeconfig_larger_than_4_mib_or_not_a_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "kubeconfig"
    big.write_text(_WELL_FORMED + "#" * (4 << 20))
    with pytest.raises(ConfigError, match=r"more than the 4 MiB allowed$"):
        kc.from_kubeconfig(str(big))
    with pytest.raises(ConfigError, match=r"^kubeconfig /dev/zero: not a regular file$"):
        kc.from_kubeconfig("/dev/zero")


def test_the_well_formed_kubeconfig_of_these_tests_loads(tmp_path: Path) -> None:
    (tmp_path / "kubeconfig").write_text(_WELL_FORMED)
    assert kc.from_kubeconfig(str(tmp_path / "kubeconfig")).token == "abc"


def test_a_token_file_that_cannot_be_read_is_a_transient_error_naming_it_not_an_oserror(
    tmp_path: Path,
) -> None:
    client = kubeclient.Client(
        kc.Credentials(server="http://127.0.0.1:9", token_file="/dev/zero"), user_agent="t"
    )
    with pytest.raises(TransientApiError, match=r"^token file /dev/zero: not a regular file$"):
        client.request("GET", "/api")


def test_a_missing_kubeconfig_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope"):
        kubeclient.load(str(tmp_path / "nope"), user_agent="t")


def test_an_exec_plugin_user_goes_through_the_kubernetes_loader_and_its_token_is_sent(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import json\nprint(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', "
        "'kind': 'ExecCredential', 'status': {'token': 'from-exec'}}))\n"
    )
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(plugin)],
            "interactiveMode": "Never",
        }
    }
    creds = kc.from_kubeconfig(str(write_kubeconfig(tmp_path, user)))
    assert creds.authorization is not None and creds.authorization() == "Bearer from-exec"
    assert creds.server == "https://10.0.0.1:6443"


# Issue 12's review, defect 15: proxies.
def test_defect_15_a_plain_kubeconfig_honours_https_proxy_and_no_proxy(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    cluster = {"server": "https://api.cluster.example:6443", "insecure-skip-tls-verify": True}
    path = str(write_kubeconfig(tmp_path, {"token": "t"}, cluster))
    clean_env.setenv("HTTPS_PROXY", "http://proxy.corp.example:3128")
    assert kubeconfig.from_kubeconfig(path).proxy == "http://proxy.corp.example:3128"
    clean_env.setenv("NO_PROXY", "localhost,.cluster.example")
    assert kubeconfig.from_kubeconfig(path).proxy is None


def test_defect_15_an_exec_plugin_kubeconfig_honours_no_proxy(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    credential = json.dumps(
        {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": {"token": "t"}}
    )
    plugin = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": sys.executable,
        "args": ["-c", f"print({credential!r})"],
        "interactiveMode": "Never",
    }
    cluster = {"server": "https://10.20.30.40:6443", "insecure-skip-tls-verify": True}
    path = str(write_kubeconfig(tmp_path, {"exec": plugin}, cluster))
    clean_env.setenv("HTTPS_PROXY", "http://proxy.corp.example:3128")
    creds = kubeconfig.from_kubeconfig(path)
    assert creds.proxy == "http://proxy.corp.example:3128"
    assert creds.authorization is not None and creds.authorization() == "Bearer t"
    clean_env.setenv("NO_PROXY", "10.0.0.0/8")
    assert kubeconfig.from_kubeconfig(path).proxy is None


def test_in_cluster_reads_the_service_account_files_and_brackets_ipv6(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "ca.crt").write_bytes(self_signed_pem()[0])
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    creds = kc.in_cluster(str(tmp_path))
    assert creds.server == "https://[fd00::1]:443"
    assert creds.token_file == str(tmp_path / "token") and creds.ca_file == str(tmp_path / "ca.crt")


def test_in_cluster_without_a_token_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ca.crt").write_bytes(self_signed_pem()[0])
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(ConfigError, match="token is missing or empty"):
        kc.in_cluster(str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT")
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_PORT"):
        kc.in_cluster(str(tmp_path))


def test_the_cli_never_imports_the_kubernetes_package_for_a_token_kubeconfig(tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path, {"token": "abc"}, {"server": "http://127.0.0.1:9"})
    code = (
        "import sys; import gpuguard.quarantine.node.writers; "
        "from gpuguard.kube.client import load; load(sys.argv[1]); "
        "print('kubernetes' in sys.modules)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert r.stdout.strip() == "False"


# -- the HTTP exchange -------------------------------------------------------------------------------------


class Recorder(BaseHTTPRequestHandler):
    """A tiny API server stand-in: records each request and answers with the next queued reply."""

    seen: ClassVar[list[dict[str, Any]]] = []
    replies: ClassVar[list[tuple[int, dict[str, str], bytes]]] = []

    def _reply(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        type(self).seen.append(
            {
                "method": self.command,
                "path": self.path,
                "headers": dict(self.headers),
                "body": self.rfile.read(length) if length else b"",
            }
        )
        status, headers, body = type(self).replies.pop(0) if type(self).replies else (200, {}, b"{}")
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PATCH = do_POST = _reply

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    Recorder.seen, Recorder.replies = [], []
    with http_server(Recorder) as url:
        yield url


NODE = {"metadata": {"name": "gpu/1", "resourceVersion": "7", "uid": "u"}, "spec": {}, "status": {}}


def test_a_request_carries_the_token_user_agent_and_json_body(server: str) -> None:
    client = kubeclient.Client(kc.Credentials(server=server, token="t0k"), user_agent="gpuguard/x")
    Recorder.replies = [(200, {}, json.dumps(NODE).encode())]
    doc = client.request(
        "PATCH", "/api/v1/nodes/n", body={"a": 1}, content_type="application/merge-patch+json"
    )
    assert doc == NODE
    req = Recorder.seen[0]
    assert req["method"] == "PATCH" and req["path"] == "/api/v1/nodes/n"
    assert req["headers"]["Authorization"] == "Bearer t0k" and req["headers"]["User-Agent"] == "gpuguard/x"
    assert req["headers"]["Content-Type"] == "application/merge-patch+json"
    assert json.loads(req["body"]) == {"a": 1}


def test_a_node_name_and_a_query_are_escaped(server: str) -> None:
    client = kubeclient.Client(kc.Credentials(server=server), user_agent="t")
    client.request("GET", kubeclient.path_of("api/v1/nodes", "a/b?c"), query={"labelSelector": "x=y,z"})
    assert Recorder.seen[0]["path"] == "/api/v1/nodes/a%2Fb%3Fc?labelSelector=x%3Dy%2Cz"
    assert "Authorization" not in Recorder.seen[0]["headers"]


def test_a_rotated_token_file_is_read_again(server: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    client = kubeclient.Client(kc.Credentials(server=server, token_file=str(token)), user_agent="t")
    client.request("GET", "/x")
    client.request("GET", "/x")
    token.write_text("second\n")
    os.utime(token, (time.time() + 5, time.time() + 5))  # a new mtime even on a coarse clock
    client.request("GET", "/x")
    assert [r["headers"]["Authorization"] for r in Recorder.seen] == ["Bearer first"] * 2 + ["Bearer second"]


def test_a_token_file_gone_mid_rotation_keeps_the_last_token(server: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first")
    client = kubeclient.Client(kc.Credentials(server=server, token_file=str(token)), user_agent="t")
    client.request("GET", "/x")
    token.unlink()
    client.request("GET", "/x")
    assert Recorder.seen[1]["headers"]["Authorization"] == "Bearer first"


@pytest.mark.parametrize(
    ("status", "headers", "body", "error", "text"),
    [
        (409, {}, b'{"kind":"Status","message":"the object has been modified"}', ConflictError, "modified"),
        (429, {"Retry-After": "3"}, b'{"message":"too many requests"}', TransientApiError, "429"),
        (503, {}, b"<html>bad gateway</html>", TransientApiError, "503"),
        (403, {}, b'{"message":"nodes \\"n\\" is forbidden"}', PermanentApiError, "forbidden"),
        (422, {}, b'{"message":"taints[0].value: Invalid\\nvalue"}', PermanentApiError, "Invalid value"),
        (200, {}, b"not json", TransientApiError, "JSONDecodeError"),
    ],
)
def test_the_writer_translates_each_answer_into_gpuguards_errors(  # noqa: PLR0917 - the parameter table
    server: str, status: int, headers: dict[str, str], body: bytes, error: type[Exception], text: str
) -> None:
    client = kubeclient.Client(kc.Credentials(server=server), user_agent="t")
    writer = KubeNodeWriter("n", api=client)
    Recorder.replies = [(status, headers, body)]
    with pytest.raises(error, match=text) as err:
        writer.read()
    if status == 429:
        assert isinstance(err.value, TransientApiError) and err.value.retry_after == 3.0


def test_no_answer_at_all_is_transient() -> None:
    client = kubeclient.Client(kc.Credentials(server="http://127.0.0.1:9"), user_agent="t")
    with pytest.raises(TransientApiError, match="read node n"):
        KubeNodeWriter("n", api=client, timeout=2).read()


def test_the_writer_speaks_the_node_endpoints(server: str) -> None:
    client = kubeclient.Client(kc.Credentials(server=server), user_agent="t")
    writer = KubeNodeWriter("gpu/1", api=client)
    no_headers: dict[str, str] = {}
    quarantined_label = {"gpuguard.io/quarantined": "true"}
    since = {"gpuguard.io/since": "2026-01-02T03:04:05Z"}
    quarantined = {"items": [{"metadata": {"name": "q", "labels": quarantined_label, "annotations": since}}]}
    fleet = [
        {"metadata": {"name": f"n{i}", "labels": quarantined_label, "annotations": since}}
        if i < 2
        else {"metadata": {"name": f"n{i}"}}
        for i in range(30)
    ]
    Recorder.replies = [
        (200, no_headers, json.dumps(NODE).encode()),
        (200, no_headers, json.dumps(NODE).encode()),
        (200, no_headers, json.dumps({"items": fleet}).encode()),
        (200, no_headers, json.dumps(quarantined).encode()),
        (200, no_headers, b'{"items": null}'),  # what the API server sends for an empty metadata list
    ]
    node = writer.read()
    assert isinstance(node, NodeView) and node.resource_version == "7"
    writer.set_condition(
        node, {"type": "GPUHealthy", "status": "True", "reason": "AllGPUsHealthy", "message": "ok"}
    )
    # A percentage: the fleet's metadata, one list (30 GPU nodes + this one; 2 of them quarantined).
    budget = writer.budget(QuarantineLimit.parse("10%"), exclude="gpu/1")
    assert budget == Budget(quarantined=2, limit=4, gpu_nodes=31)
    # A count needs no total: the quarantined nodes only.
    assert writer.budget(QuarantineLimit.parse("3"), exclude="gpu/1") == Budget(quarantined=1, limit=3)
    assert writer.quarantine_order() == []
    quarantined_query = (
        "/api/v1/nodes?labelSelector=gpuguard.io%2Fquarantined%3Dtrue%2Cnvidia.com%2Fgpu.present%3Dtrue"
    )
    metadata = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
    got = [
        (r["method"], r["path"], r["headers"].get("Content-Type"), r["headers"]["Accept"])
        for r in Recorder.seen
    ]
    assert got == [
        ("GET", "/api/v1/nodes/gpu%2F1", None, "application/json"),
        (
            "PATCH",
            "/api/v1/nodes/gpu%2F1/status",
            "application/strategic-merge-patch+json",
            "application/json",
        ),
        ("GET", "/api/v1/nodes?labelSelector=nvidia.com%2Fgpu.present%3Dtrue", None, metadata),
        ("GET", quarantined_query, None, metadata),
        ("GET", quarantined_query, None, metadata),
    ]


def test_an_event_goes_to_the_event_namespace_with_its_message_bounded(server: str) -> None:
    """A fault's text can be long (every GPU of a node, NVML's own strings): the Event carries at most
    MAX_EVENT_MESSAGE_BYTES of it, and goes only where the Role lets the agent write Events."""
    client = kubeclient.Client(kc.Credentials(server=server), user_agent="t")
    node = NodeView(name="gpu-1", uid="u-1")
    KubeNodeWriter("gpu-1", api=client).record_event(
        node, EventSpec("Warning", "GPUUnhealthy", "Xid 79 on GPU-\u00e9" + "x" * (1 << 20) + "\x1b[2J")
    )
    (request,) = Recorder.seen
    assert (request["method"], request["path"]) == ("POST", f"/api/v1/namespaces/{NODE_NAMESPACE}/events")
    event = json.loads(request["body"])
    assert event["metadata"]["namespace"] == NODE_NAMESPACE == "default"
    message = event["message"]
    assert len(message.encode()) <= MAX_EVENT_MESSAGE_BYTES and message.startswith("Xid 79 on GPU-\u00e9")
    assert message.endswith("...") and "\x1b" not in message
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": "u-1"}


def test_a_server_that_is_not_a_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not an http"):
        kubeclient.Client(kc.Credentials(server="10.0.0.1:6443"), user_agent="t")


def test_connections_to_the_api_server_probe_a_silent_peer_with_tcp_keepalive(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget's watch is held for up to an hour: a connection dropped in silence must not go unseen."""
    opened: list[tuple[int, int]] = []
    create = urllib3.util.connection.create_connection

    def recording(*args: Any, **kw: Any) -> socket.socket:
        sock = create(*args, **kw)
        keepalive = sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        opened.append((keepalive, sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)))
        return sock

    monkeypatch.setattr(urllib3.util.connection, "create_connection", recording)
    client = kubeclient.Client(kc.Credentials(server=server), user_agent="t")
    Recorder.replies = [(200, {}, json.dumps(NODE).encode())]
    client.request("GET", "/api/v1/nodes/n")
    assert opened == [(1, 60)]  # probes after a minute of silence
