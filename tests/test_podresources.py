"""The PodResources client against a real gRPC server on a unix socket that serves the official proto
(harness.kubelet), and the committed stubs against the proto."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.core.errors import KubeletUnavailable, KubeletUnsupported
from gpuguard.core.model import PodDevices
from gpuguard.kube.podresources.client import PodResourcesClient
from harness.kubelet import FakeContainer, FakeKubelet, FakePod, gpu_pod

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "gpuguard" / "kube" / "podresources" / "v1"


@pytest.fixture
def sock() -> Iterator[str]:
    # A short folder: a unix socket's path has at most 107 bytes, and pytest's tmp_path can be longer.
    folder = tempfile.mkdtemp(prefix="kubelet-", dir="/tmp")
    yield f"{folder}/kubelet.sock"
    shutil.rmtree(folder, ignore_errors=True)


def test_list_reports_each_pods_device_plugin_gpus_and_dra_devices(sock: str) -> None:
    pods = [gpu_pod("ml", f"train-{i}", f"GPU-{i}") for i in range(8)]
    pods.append(
        FakePod(
            "ml",
            "dra",
            [
                FakeContainer("a", claims=[("gpu.nvidia.com", "node-1", "gpu-0")]),
                FakeContainer(
                    "b", {"example.com/nic": ["nic0"]}, claims=[("gpu.nvidia.com", "node-1", "gpu-0")]
                ),
            ],
        )
    )
    pods.append(FakePod("kube-system", "no-devices", [FakeContainer("c")]))
    with FakeKubelet(sock, pods=pods):
        client = PodResourcesClient(sock, timeout=5)
        got = client.list()
        client.close()
    assert got[3] == PodDevices("ml", "train-3", devices=(("nvidia.com/gpu", "GPU-3"),))
    assert got[8] == PodDevices(
        "ml", "dra", devices=(("example.com/nic", "nic0"),), claims=(("gpu.nvidia.com", "node-1", "gpu-0"),)
    )
    assert got[9] == PodDevices("kube-system", "no-devices")
    assert len(got) == 10


def test_get_of_a_pod_that_left_between_the_list_and_the_eviction_is_none(sock: str) -> None:
    with FakeKubelet(sock, pods=[gpu_pod("ml", "a", "GPU-1"), gpu_pod("ml", "b", "GPU-2")]) as kubelet:
        client = PodResourcesClient(sock)
        assert [p.name for p in client.list()] == ["a", "b"]
        kubelet.remove("ml", "a")
        assert client.get("ml", "a") is None
        assert client.get("ml", "b") == PodDevices("ml", "b", devices=(("nvidia.com/gpu", "GPU-2"),))
        assert kubelet.calls == ["List", "Get ml/a", "Get ml/b"]


def test_no_socket_is_kubelet_unavailable_and_names_the_mount(sock: str) -> None:
    with pytest.raises(KubeletUnavailable, match=r"no socket .*pod-resources mounted"):
        PodResourcesClient(sock).list()


def test_a_socket_nobody_listens_on_is_kubelet_unavailable(sock: str) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(sock)  # the file is there, nothing accepts (a kubelet that stopped)
    s.close()
    t0 = time.monotonic()
    with pytest.raises(KubeletUnavailable, match="UNAVAILABLE"):
        PodResourcesClient(sock, timeout=2).list()
    assert time.monotonic() - t0 < 5


def test_a_kubelet_that_accepts_and_never_answers_is_unavailable_within_the_deadline(sock: str) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(sock)
    s.listen(8)  # the kernel accepts the connection; nothing speaks HTTP/2 on it
    try:
        t0 = time.monotonic()
        with pytest.raises(KubeletUnavailable, match=r"DEADLINE_EXCEEDED|UNAVAILABLE"):
            PodResourcesClient(sock, timeout=1).list()
        assert time.monotonic() - t0 < 4
    finally:
        s.close()


def test_a_kubelet_without_the_api_is_kubelet_unsupported(sock: str) -> None:
    with FakeKubelet(sock, unimplemented=True):
        client = PodResourcesClient(sock)
        with pytest.raises(KubeletUnsupported, match="UNIMPLEMENTED"):
            client.list()
        with pytest.raises(KubeletUnsupported):
            client.get("ml", "a")


def test_the_client_reconnects_to_a_kubelet_that_restarted(sock: str) -> None:
    client = PodResourcesClient(sock, timeout=5)
    with FakeKubelet(sock, pods=[gpu_pod("ml", "a", "GPU-1")]):
        assert len(client.list()) == 1
    Path(sock).unlink(missing_ok=True)
    with pytest.raises(KubeletUnavailable):
        client.list()
    with FakeKubelet(sock, pods=[gpu_pod("ml", "a", "GPU-1"), gpu_pod("ml", "b", "GPU-2")]):
        assert len(client.list()) == 2


def test_the_committed_stubs_are_what_make_podresources_stubs_generates_from_the_proto(
    tmp_path: Path,
) -> None:
    target = tmp_path / "gpuguard" / "kube" / "podresources" / "v1"
    target.mkdir(parents=True)
    shutil.copy(STUBS / "api.proto", target / "api.proto")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            "--python_out=.",
            "--pyi_out=.",
            "--grpc_python_out=.",
            "gpuguard/kube/podresources/v1/api.proto",
        ],
        cwd=tmp_path,
        check=True,
    )
    for name in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"):
        assert (target / name).read_text() == (STUBS / name).read_text(), (
            f"{name}: run make podresources-stubs"
        )


def test_the_makefile_target_runs_the_same_command_as_the_sync_test() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "-m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=." in makefile
