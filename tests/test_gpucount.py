"""`check` learns the expected GPU count from its node's label (gpuguard.runtime.gpucount): the value's
bounds, what it does without an answer, and the CLI end to end against a small HTTP server that serves one
Node."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from gpuguard.core.config import GPU_COUNT_LABEL
from gpuguard.core.errors import PermanentApiError, TransientApiError
from gpuguard.kube import client as kubeclient
from gpuguard.runtime.gpucount import MAX_GPUS, expected_from_labels, node_labels, parse_count
from tests.test_cli import run, write


@pytest.mark.parametrize(
    ("value", "count"),
    [
        ("8", 8),
        ("1", 1),
        (str(MAX_GPUS), MAX_GPUS),
        ("0", None),
        (str(MAX_GPUS + 1), None),
        ("99999", None),
        ("-1", None),
        ("8.0", None),
        (" 8", None),
        ("", None),
        ("eight", None),
        ("\uff18", None),  # a fullwidth digit 8: not ASCII
        (8, None),  # not a string: a label's value always is
        (None, None),
    ],
)
def test_a_label_value_is_a_count_only_when_it_is_an_integer_from_1_to_1024(
    value: Any, count: int | None
) -> None:
    assert parse_count(value) == count


class _Api(kubeclient.Client):
    """A client whose one read answers `node` (or raises `error`), recording the paths read."""

    def __init__(self, node: Any = None, error: Exception | None = None) -> None:
        self.node, self.error = node, error
        self.paths: list[tuple[str, str, Any]] = []

    def request(self, method: str, path: str, **kw: Any) -> Any:
        self.paths.append((method, path, kw.get("timeout")))
        if self.error is not None:
            raise self.error
        return self.node


def expected_from_node(
    node: str, *, kubeconfig: str | None, label: str = GPU_COUNT_LABEL, api: Any
) -> int | None:
    """The count as `check` takes it from its one read of the node (gpuguard.runtime.checknode)."""
    labels = node_labels(node, kubeconfig=kubeconfig, api=api)
    return None if labels is None else expected_from_labels(labels, node=node, label=label)


def _node(labels: dict[str, str] | None) -> dict[str, Any]:
    return {"metadata": {"name": "gpu-1", "labels": labels} if labels is not None else {"name": "gpu-1"}}


def test_the_count_comes_from_the_named_label_of_the_named_node_in_one_read_with_a_short_timeout() -> None:
    api = _Api(_node({"nvidia.com/gpu.count": "8", "my/gpus": "4"}))
    assert expected_from_node("gpu-1", kubeconfig=None, api=api) == 8
    assert expected_from_node("gpu-1", kubeconfig=None, label="my/gpus", api=api) == 4
    assert api.paths == [("GET", "/api/v1/nodes/gpu-1", 3.0)] * 2


@pytest.mark.parametrize("node", [_node(None), _node({}), {"metadata": None}, {}, None, "not a node"])
def test_a_node_without_the_label_gives_no_expectation(node: Any) -> None:
    with capture_logs() as logs:
        assert expected_from_node("gpu-1", kubeconfig=None, api=_Api(node)) is None
    assert [e["event"] for e in logs] == ["check.expected_gpus_label_absent"]


def test_a_label_that_is_not_a_bounded_count_is_ignored_with_a_warning_that_shows_it_escaped() -> None:
    with capture_logs() as logs:
        assert (
            expected_from_node("gpu-1", kubeconfig=None, api=_Api(_node({"nvidia.com/gpu.count": "9\x1b"})))
            is None
        )
    (line,) = logs
    assert line["event"] == "check.expected_gpus_label_invalid" and line["log_level"] == "warning"
    assert line["value"] == "9\\x1b" and line["action"] == "ignored"


@pytest.mark.parametrize(
    "error",
    [
        TransientApiError("read node gpu-1: ConnectTimeoutError"),
        PermanentApiError("read node gpu-1: 403 Forbidden", status=403),
        PermanentApiError("read node gpu-1: 404 Not Found", status=404),
    ],
)
def test_an_api_that_does_not_answer_or_refuses_gives_no_expectation_and_a_warning(error: Exception) -> None:
    with capture_logs() as logs:
        assert expected_from_node("gpu-1", kubeconfig=None, api=_Api(error=error)) is None
    (line,) = logs
    assert line["event"] == "check.node_unread" and line["log_level"] == "warning"
    assert str(error) in line["error"]


# -- the CLI end to end ------------------------------------------------------------------------------------


class _NodeServer:
    """An HTTP 'API server' serving GET /api/v1/nodes/<name> from `nodes`; it records every path asked."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.paths: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.paths.append(self.path)
                name = self.path.rsplit("/", 1)[-1]
                body = server.nodes.get(name)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(body or {"kind": "Status", "code": 404}).encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def kubeconfig(self, path: Path, url: str | None = None) -> str:
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": url or self.url}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )
        return str(path)


@pytest.fixture
def api() -> Iterator[_NodeServer]:
    s = _NodeServer()
    yield s
    s.httpd.shutdown()


def _check(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    scenario = write(tmp_path, "gpus: 7")
    return run("check", "--backend", "mock", "--scenario", scenario, *args, env=env)


def test_check_fails_a_node_labelled_with_8_gpus_that_shows_7(api: _NodeServer, tmp_path: Path) -> None:
    api.nodes["gpu-1"] = _node({"nvidia.com/gpu.count": "8"})
    r = _check(tmp_path, "--kubeconfig", api.kubeconfig(tmp_path / "kc"), env={"NODE_NAME": "gpu-1"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "expected 8 GPUs, NVML reports 7" in r.stdout
    assert api.paths == ["/api/v1/nodes/gpu-1"]
    # As many as the label says: healthy.
    api.nodes["gpu-1"] = _node({"nvidia.com/gpu.count": "7"})
    r = _check(tmp_path, "--kubeconfig", str(tmp_path / "kc"), "--node", "gpu-1")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_flag_wins_and_the_node_is_not_read(api: _NodeServer, tmp_path: Path) -> None:
    api.nodes["gpu-1"] = _node({"nvidia.com/gpu.count": "8"})
    kc = api.kubeconfig(tmp_path / "kc")
    r = _check(tmp_path, "--kubeconfig", kc, "--node", "gpu-1", "--expected-gpus", "7")
    assert r.returncode == 0, r.stdout + r.stderr
    r = _check(tmp_path, "--kubeconfig", kc, "--node", "gpu-1", "--expected-gpus", "8")
    assert r.returncode == 1 and "expected 8 GPUs, NVML reports 7" in r.stdout
    assert api.paths == []


def test_the_node_is_read_only_with_a_cluster_and_a_node_named_and_a_label_to_read(
    api: _NodeServer, tmp_path: Path
) -> None:
    api.nodes["gpu-1"] = _node({"nvidia.com/gpu.count": "8"})
    kc = api.kubeconfig(tmp_path / "kc")
    assert _check(tmp_path, "--kubeconfig", kc).returncode == 0  # no node
    assert _check(tmp_path, "--node", "gpu-1", env={"HOME": str(tmp_path)}).returncode == 0  # no cluster
    assert (
        _check(tmp_path, "--kubeconfig", kc, "--node", "gpu-1", "--expected-gpus-label", "").returncode == 0
    )
    assert api.paths == []
    # KUBECONFIG names the cluster as well as the flag does.
    r = _check(tmp_path, "--node", "gpu-1", env={"KUBECONFIG": kc})
    assert r.returncode == 1 and api.paths == ["/api/v1/nodes/gpu-1"]


def test_a_container_that_sees_only_its_allocated_gpus_does_not_expect_the_nodes_count(
    api: _NodeServer, tmp_path: Path
) -> None:
    api.nodes["gpu-1"] = _node({"nvidia.com/gpu.count": "8"})
    kc = api.kubeconfig(tmp_path / "kc")
    r = _check(tmp_path, "--kubeconfig", kc, "--node", "gpu-1", env={"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert api.paths == []
    r = _check(tmp_path, "--kubeconfig", kc, "--node", "gpu-1", env={"NVIDIA_VISIBLE_DEVICES": "all"})
    assert r.returncode == 1


def test_an_unreachable_api_server_does_not_fail_the_check_and_says_why(tmp_path: Path) -> None:
    closed = _NodeServer()
    url = closed.url
    closed.httpd.shutdown()
    closed.httpd.server_close()
    kc = closed.kubeconfig(tmp_path / "kc", url)
    r = _check(tmp_path, "--kubeconfig", kc, "--node", "gpu-1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check.node_unread" in r.stderr and "Traceback" not in r.stderr


def test_an_invalid_label_does_not_fail_the_check_and_says_so(api: _NodeServer, tmp_path: Path) -> None:
    api.nodes["gpu-1"] = _node({"nvidia.com/gpu.count": "100000"})
    r = _check(tmp_path, "--kubeconfig", api.kubeconfig(tmp_path / "kc"), "--node", "gpu-1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check.expected_gpus_label_invalid" in r.stderr


def test_an_expected_gpus_label_that_is_not_a_label_key_is_a_usage_error(tmp_path: Path) -> None:
    r = _check(tmp_path, "--expected-gpus-label", "not a key")
    assert r.returncode == 2 and "--expected-gpus-label" in r.stderr and "Traceback" not in r.stderr
