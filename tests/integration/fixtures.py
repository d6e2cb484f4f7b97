"""Shared fixtures of the integration tests: the deploy manifests applied once, and agents started as the
DaemonSet's ServiceAccount on nodes the tests create; and the node readers the review-defect tests share."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from gpuguard import __version__
from harness.kube import GPUS_OK, TAINT_KEY, Admin, Agent, agent_as_node, eventually

USER_AGENT = f"gpuguard/{__version__}"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
_names = itertools.count()


@pytest.fixture(scope="session")
def admin(admin_api: kubernetes.client.ApiClient) -> Admin:
    a = Admin(admin_api)
    created = a.apply_deploy_manifests()
    assert {
        "Namespace/gpuguard",
        "ServiceAccount/gpuguard",
        "ClusterRole/gpuguard",
        "ClusterRoleBinding/gpuguard",
        "Role/gpuguard",
        "RoleBinding/gpuguard",
        "DaemonSet/gpuguard",
    } <= set(created)
    return a


@pytest.fixture
def start_agent(
    admin: Admin, control_plane: Any, fakenvml: Path, tmp_path: Path
) -> Iterator[Callable[..., tuple[Agent, str, Path]]]:
    """start_agent(node=None, state=None, args=(), env=None) -> (agent, node name, state file); a node is
    created if not given (node_kw: Admin.make_node's). Every agent is stopped at the end."""
    agents: list[Agent] = []

    def start(
        node: str | None = None,
        state: Path | None = None,
        args: tuple[str, ...] = (),
        host_boot_id: str = "host-boot-1",
        env: dict[str, str] | None = None,
        **node_kw: Any,
    ) -> tuple[Agent, str, Path]:
        if node is None:
            node = f"gpu-node-{next(_names)}-{int(time.time() * 1000) % 100000}"
            admin.make_node(node, **node_kw)
        if state is None:
            state = tmp_path / f"{node}.state"
            state.write_text(GPUS_OK)
        if not any(a.startswith("--max-quarantined") for a in args):
            # The budget is cluster-wide and other tests leave quarantined nodes behind: only the budget
            # test sets one.
            args = ("--max-quarantined", "100%", *args)
        agent = agent_as_node(
            admin,
            control_plane,
            node,
            state=state,
            lib=fakenvml,
            args=args,
            host_boot_id=host_boot_id,
            env=env,
        ).start()
        agents.append(agent)
        eventually(agent.ready, 15, what="agent /readyz")
        return agent, node, state

    yield start
    for a in agents:
        if a.proc is not None and a.proc.poll() is None:
            a.stop()
        # Shown by pytest only when the test failed: what each agent said above info.
        for line in a.lines:
            if line.get("level") in ("warning", "error") or line.get("event") == "non-json":
                print(a.node, line)


# -- what the tests of issue 12's review share ------------------------------------------------------------

# How soon the agent sees what others changed on its node, passed as an environment variable, not a flag, so
# that the same test runs against a version without the setting and fails there for the defect's own reason.
RESYNC = {"GPUGUARD_NODE_RESYNC": "0.3"}
ECC = GPUS_OK.replace("GPU-it-0", "GPU-it-0 ecc=2")
LABEL = "gpuguard.io/quarantined"  # the budget's label


def labels(admin: Admin, node: str) -> dict[str, str]:
    return admin.node(node)["metadata"].get("labels") or {}


def annotations_of(admin: Admin, node: str) -> dict[str, str]:
    return admin.node(node)["metadata"].get("annotations") or {}


def remove_our_taint(admin: Admin, node: str) -> None:
    admin.update_node(
        node,
        lambda n: {"spec": {"taints": [t for t in n["spec"].get("taints") or [] if t["key"] != TAINT_KEY]}},
    )


def unique(prefix: str) -> str:
    return f"{prefix}-{time.monotonic_ns() % 10**9}"
