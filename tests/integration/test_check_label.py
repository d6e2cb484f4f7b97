"""`gpuguard check` expects the GPU count its node's label holds (issue 24, item 5), and applies the
--signals-config node rules its labels select, read from the real kube-apiserver with the DaemonSet
ServiceAccount's token, over the fake NVML library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.kube import GPU_NODE_LABELS, Admin, token_kubeconfig, unique_node
from tests.integration.fixtures import admin  # noqa: F401

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _check(
    lib: Path, state: Path, node: str, kubeconfig: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuguard", "check", "--backend", "nvml", "--node", node, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "LD_LIBRARY_PATH": str(lib),
            "FAKE_NVML_STATE": str(state),
            "KUBECONFIG": str(kubeconfig),
        },
    )


def test_check_fails_a_node_labelled_with_8_gpus_whose_library_shows_7(
    admin: Admin, control_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    node = unique_node(admin, "gpu-count", labels={**GPU_NODE_LABELS, "nvidia.com/gpu.count": "8"})
    kubeconfig = token_kubeconfig(
        tmp_path / "kubeconfig",
        server=control_plane.url,
        ca_path=control_plane.ca_path,
        token=admin.agent_token(node),
    )
    state = tmp_path / "nvml.state"
    state.write_text("".join(f"gpu {i} uuid=GPU-count-{i}\n" for i in range(7)))
    r = _check(fakenvml, state, node, kubeconfig)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "gpu-missing: expected 8 GPUs, NVML reports 7" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr
    # The eighth GPU is back: the same check passes.
    state.write_text(state.read_text() + "gpu 7 uuid=GPU-count-7\n")
    r = _check(fakenvml, state, node, kubeconfig)
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_applies_the_signals_config_rule_its_nodes_labels_select(
    admin: Admin, control_plane: Any, fakenvml: Path, tmp_path: Path
) -> None:
    rules = tmp_path / "signals.yaml"
    rules.write_text(
        "nodes:\n  - selector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}\n"
        "    signals: {fabric-status: {level: ignore}}\n"
    )
    state = tmp_path / "nvml.state"
    state.write_text(
        "".join(f"gpu {i} uuid=GPU-rule-{i} fabric_state=3 fabric_status=UNKNOWN\n" for i in range(2))
    )
    for product, rc in (("NVIDIA-H100-80GB-HBM3", 0), ("NVIDIA-A100-SXM4-80GB", 1)):
        labels = {**GPU_NODE_LABELS, "nvidia.com/gpu.count": "2", "nvidia.com/gpu.product": product}
        node = unique_node(admin, "gpu-rules", labels=labels)
        kubeconfig = token_kubeconfig(
            tmp_path / f"kubeconfig-{rc}",
            server=control_plane.url,
            ca_path=control_plane.ca_path,
            token=admin.agent_token(node),
        )
        r = _check(fakenvml, state, node, kubeconfig, "--signals-config", str(rules))
        assert r.returncode == rc, product + r.stdout + r.stderr
        assert ("fabric-status" in r.stdout) == (rc == 1) and "Traceback" not in r.stderr
