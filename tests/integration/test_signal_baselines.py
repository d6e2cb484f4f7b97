"""The signals' first-good baselines across a SIGKILL and a restart of the real `gpuguard watch` (against the
real kube-apiserver, through pynvml and the fake NVML library): a link that goes down while no agent runs is
still reported by the next one, from --state-dir/signal-baselines.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuguard.store.baselines import FILE_NAME
from harness.kube import Admin
from tests.integration.fixtures import admin, start_agent  # noqa: F401

pytestmark = pytest.mark.timeout(240)

LINKS = "gpu 0 uuid=GPU-it-0 nvlink_links=18\ngpu 1 uuid=GPU-it-1 nvlink_links=18{}\n"


def degraded(doc: dict[str, Any]) -> dict[str, list[str]]:
    return {g["uuid"]: [r.split(":")[0] for r in g["degraded"]] for g in doc["gpus"]}


def test_a_link_down_while_the_agent_was_killed_is_nvlink_down_at_the_restarted_agents_first_check(
    admin: Admin, start_agent: Any, tmp_path: Path
) -> None:
    state = tmp_path / "links.state"
    state.write_text(LINKS.format(""))
    agent, node, _ = start_agent(state=state)
    code, doc = agent.healthz()
    assert code == 200 and degraded(doc) == {"GPU-it-0": [], "GPU-it-1": []}, doc
    assert (agent.state_dir / FILE_NAME).is_file()
    agent.kill()  # an OOM kill; a rollout's new pod the same
    state.write_text(LINKS.format(" nvlink_down=3"))
    restarted, _, _ = start_agent(node=node, state=state)
    code, doc = restarted.healthz()
    assert code == 200 and degraded(doc) == {"GPU-it-0": [], "GPU-it-1": ["nvlink-down"]}, doc
