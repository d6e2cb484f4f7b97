"""The chart's signalsConfig (issue 29): a ConfigMap mounted read-only, GPUGUARD_SIGNALS_CONFIG naming the
file, a checksum that rolls the pods on a change; the file it renders is one the agent accepts, and the
default render has none of it."""

from __future__ import annotations

import pytest
import yaml

from gpuguard.core.signalconfig import parse
from tests.helmtool import Docs, Helm, build_helm
from tests.test_helm import _agent, _by_kind, _env, _pod_spec


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return build_helm(tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="module")
def default_render(helm: Helm) -> Docs:
    return helm.render()


VALUES = (
    "--set",
    "signalsConfig.signals.pcie-replays.threshold=16",
    "--set-string",
    "signalsConfig.nodes[0].selector.nvidia\\.com/gpu\\.product=NVIDIA-H100-PCIe",
    "--set",
    "signalsConfig.nodes[0].signals.nvlink-down.level=ignore",
)


def test_signals_config_renders_a_read_only_configmap_the_agent_reads(
    helm: Helm, default_render: Docs
) -> None:
    rendered = helm.render(*VALUES)
    kinds = _by_kind(rendered)
    cm = kinds["ConfigMap"]
    assert cm["metadata"]["name"] == "gpuguard-signals"
    config = parse(cm["data"]["signals.yaml"])  # what the agent will parse: valid
    assert config.table(None)["pcie-replays"].threshold == 16
    assert config.table({"nvidia.com/gpu.product": "NVIDIA-H100-PCIe"}).level("nvlink-down") == "ignore"
    assert _env(rendered)["GPUGUARD_SIGNALS_CONFIG"] == "/etc/gpuguard/signals/signals.yaml"
    mount = next(m for m in _agent(rendered)["volumeMounts"] if m["name"] == "signals-config")
    assert mount == {"name": "signals-config", "mountPath": "/etc/gpuguard/signals", "readOnly": True}
    volume = next(v for v in _pod_spec(rendered)["volumes"] if v["name"] == "signals-config")
    assert volume["configMap"]["name"] == "gpuguard-signals"
    annotations = kinds["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
    other = helm.render(*VALUES[:-1], "signalsConfig.nodes[0].signals.nvlink-down.level=fault")
    other_annotations = _by_kind(other)["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["checksum/signals-config"] != other_annotations["checksum/signals-config"]
    assert not any(d["kind"] == "ConfigMap" for d in default_render)
    assert "GPUGUARD_SIGNALS_CONFIG" not in _env(default_render)
    assert yaml.safe_dump(default_render) == yaml.safe_dump(helm.render("--set", "signalsConfig=null"))
