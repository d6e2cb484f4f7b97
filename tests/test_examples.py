"""deploy/examples/inference-preflight.yaml: an LLM serving Deployment with a `gpuguard check` preflight.

What makes the pattern work: the init container runs `gpuguard check` on the same GPU the worker gets
(it requests the same nvidia.com/gpu count and picks no GPUs itself), nothing tolerates gpuguard's taints,
and the preflight runs hardened. The command is also run for real against the fake NVML library: exit 0
on a healthy GPU, 1 on a bad one, which is what keeps the worker from starting.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.cli import cli
from gpuguard.core.config import TAINT_EFFECTS
from gpuguard.quarantine.record import TAINT_KEY
from tests.test_manifests import _all_keys, _tolerates

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "examples" / "inference-preflight.yaml"
MANIFEST = ROOT / "deploy" / "daemonset.yaml"
GPU = "nvidia.com/gpu"


@cache
def _documents() -> tuple[dict[str, Any], ...]:
    with EXAMPLE.open(encoding="utf-8") as f:
        return tuple(d for d in yaml.safe_load_all(f) if d is not None)


def _deployment() -> dict[str, Any]:
    (doc,) = _documents()
    assert doc["kind"] == "Deployment"
    return doc


def _pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = _deployment()["spec"]["template"]["spec"]
    return spec


def _preflight() -> dict[str, Any]:
    init = _pod_spec()["initContainers"]
    assert [c["name"] for c in init] == ["gpu-preflight"], "the preflight is the only init container"
    container: dict[str, Any] = init[0]
    return container


def _worker() -> dict[str, Any]:
    containers = _pod_spec()["containers"]
    assert [c["name"] for c in containers] == ["vllm"]
    container: dict[str, Any] = containers[0]
    return container


def _gpus(container: dict[str, Any]) -> int:
    """The container's nvidia.com/gpu count: an extended resource, so requests (if given) equal limits."""
    resources = container.get("resources", {})
    limit = resources.get("limits", {}).get(GPU)
    request = resources.get("requests", {}).get(GPU, limit)
    assert request == limit, f"{container['name']}: {GPU} requests must equal limits"
    return int(limit or 0)


def _command(container: dict[str, Any]) -> list[str]:
    """What the container runs; the gpuguard image's ENTRYPOINT is ["gpuguard"]."""
    return [*container.get("command", ["gpuguard"]), *container.get("args", [])]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


# -- the example -------------------------------------------------------------------------------------------


def test_the_example_is_one_deployment_that_matches_the_kubernetes_api_schema() -> None:
    from kubernetes import client  # heavy import: only this test needs it

    doc = _deployment()
    assert doc["apiVersion"] == "apps/v1"
    if not hasattr(client.V1Deployment, "model_validate"):
        pytest.skip("this kubernetes client has no strict (pydantic) models")
    client.V1Deployment.model_validate(doc)
    snake = [k for k in _all_keys(doc) if re.fullmatch(r"[a-z]+(_[a-z0-9]+)+", k)]
    assert not snake, f"snake_case field names: {snake}"
    spec = doc["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


def test_the_preflight_init_container_runs_gpuguard_check() -> None:
    command = _command(_preflight())
    assert command[:2] == ["gpuguard", "check"]
    assert "check" in cli.commands
    assert "--backend" not in command, "the default backend: the real NVML"


def test_the_worker_requests_a_gpu() -> None:
    assert _gpus(_worker()) >= 1


def test_the_preflight_requests_the_same_gpus_as_the_worker_so_it_checks_the_gpu_the_worker_gets() -> None:
    # kubelet hands an app container the devices its init containers were allocated first, and a pod's
    # effective request is max(init, sum of app containers): the same GPU, and no extra one.
    assert _gpus(_preflight()) == _gpus(_worker())


def test_the_preflight_does_not_pick_its_gpus_itself_and_gets_nvml() -> None:
    env = _env(_preflight())
    assert "NVIDIA_VISIBLE_DEVICES" not in env, "the device plugin sets it to the allocated GPU"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")


@pytest.mark.parametrize("effect", TAINT_EFFECTS)
def test_nothing_in_the_pod_tolerates_a_gpuguard_taint(effect: str) -> None:
    tolerations = _pod_spec().get("tolerations", [])
    assert not _tolerates(tolerations, TAINT_KEY, effect, value="xid-79")
    assert not _tolerates(tolerations, "gpuguard.io/unverified", effect)
    assert not [t for t in tolerations if t.get("key", "").startswith("gpuguard.io/")]


def test_the_preflight_runs_hardened_as_a_numeric_non_root_user() -> None:
    sc = _preflight()["securityContext"]
    assert sc["runAsNonRoot"] is True
    for key in ("runAsUser", "runAsGroup"):
        assert isinstance(sc[key], int) and not isinstance(sc[key], bool) and sc[key] != 0
    assert sc["allowPrivilegeEscalation"] is False
    assert sc.get("privileged", False) is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "volumeMounts" not in _preflight(), "it needs nothing but the GPU"


def test_the_preflight_uses_the_same_gpuguard_image_as_the_daemon_set() -> None:
    with MANIFEST.open(encoding="utf-8") as f:
        daemonset = next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "DaemonSet")
    assert _preflight()["image"] == daemonset["spec"]["template"]["spec"]["containers"][0]["image"]


def test_the_preflight_has_a_memory_limit() -> None:
    resources = _preflight()["resources"]
    assert "memory" in resources["requests"] and "memory" in resources["limits"]


# -- the preflight's command, run for real -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "exit_code"),
    [("gpu 0 uuid=GPU-0a", 0), ("gpu 0 uuid=GPU-0a ecc=2", 1), ("gpu 0 uuid=GPU-0a lost=1", 1)],
    ids=["a healthy GPU", "uncorrected ECC errors", "a GPU fallen off the bus"],
)
def test_the_preflight_command_exits_1_on_an_unhealthy_gpu_so_the_worker_never_starts(
    fakenvml: Path, tmp_path: Path, gpu: str, exit_code: int
) -> None:
    state = tmp_path / "nvml.state"
    state.write_text(gpu + "\n", encoding="utf-8")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUGUARD_", "FAKE_NVML", "NVIDIA_"))}
    base.pop("NODE_NAME", None)
    env = base | _env(_preflight()) | {"LD_LIBRARY_PATH": str(fakenvml), "FAKE_NVML_STATE": str(state)}
    command = _command(_preflight())
    result = subprocess.run(
        [sys.executable, "-m", "gpuguard", *command[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert result.returncode == exit_code, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last == "healthy" if exit_code == 0 else last.startswith("UNHEALTHY: ")
