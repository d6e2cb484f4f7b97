"""Monitoring as a Prometheus Operator user applies it: the alerting rules pass `promtool check rules` and
their unit tests (`promtool test rules`, deploy/monitoring/prometheus-rules.test.yaml), the dashboard's
queries parse, every series they use is one gpuguard exports, and the plain files in deploy/ are exactly
what the chart renders with the matching values.

promtool comes from hack/promtool/build.sh (built once from Prometheus's Go module into
~/.cache/gpuguard/promtool/; a few minutes cold). GPUGUARD_SKIP_PROMTOOL=1 skips the promtool tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gpuguard.core.metrics import Metrics
from tests.helmtool import ROOT, Helm, build_helm

MONITORING = ROOT / "deploy" / "monitoring"
RULES = MONITORING / "prometheus-rules.yaml"
RULES_TEST = MONITORING / "prometheus-rules.test.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
BUILD_SCRIPT = ROOT / "hack" / "promtool" / "build.sh"

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def promtool() -> str:
    if os.environ.get("GPUGUARD_SKIP_PROMTOOL") == "1":
        pytest.skip("GPUGUARD_SKIP_PROMTOOL=1")
    try:
        result = subprocess.run(
            [str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=1100, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hack/promtool/build.sh did not finish in {exc.timeout} s")
    if result.returncode != 0:
        pytest.fail(f"hack/promtool/build.sh failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return build_helm(tmp_path_factory.mktemp("helm-home"))


def promtool_run(promtool: str, *args: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, check=False, cwd=cwd
    )


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in doc["panels"] for t in p["targets"]]


def test_the_alerting_rules_pass_promtool_check_rules(promtool: str) -> None:
    result = promtool_run(promtool, "check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_the_alerting_rules_pass_their_unit_tests(promtool: str) -> None:
    result = promtool_run(promtool, "test", "rules", RULES_TEST.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_unit_test() -> None:
    tested = set(re.findall(r"alertname: (\w+)", RULES_TEST.read_text()))
    assert tested == {r["alert"] for r in rules()}


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (
            "expr: gpuguard_gpu_healthy == 0\n        for: 1m",
            "expr: gpuguard_gpu_healthy == 0\n        for: 3m",
        ),
        ("max by (node, dry_run) (gpuguard_node_quarantined)", "max by (node) (gpuguard_node_quarantined)"),
        ('code!~"200|409"', 'code!~"200"'),
        ("(gpuguard_gpus_quarantined) > 0", "(gpuguard_gpus_quarantined) > 1"),
        ("by (node, dry_run) (gpuguard_gpus_quarantined)", "by (node, pod) (gpuguard_gpus_quarantined)"),
        ("(gpuguard_gpus_quarantine_deferred) > 0", "(gpuguard_gpus_quarantine_deferred) > 2"),
    ],
)
def test_the_unit_tests_fail_when_a_rule_changes(
    promtool: str, tmp_path: Path, before: str, after: str
) -> None:
    text = RULES.read_text()
    assert before in text
    (tmp_path / RULES.name).write_text(text.replace(before, after))
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    result = promtool_run(promtool, "test", "rules", RULES_TEST.name, cwd=tmp_path)
    assert result.returncode != 0, result.stdout


def test_the_dashboards_queries_parse(promtool: str, tmp_path: Path) -> None:
    exprs = dashboard_exprs()
    doc = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"q:{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(doc))
    result = promtool_run(promtool, "check", "rules", "q.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_series_the_rules_and_the_dashboard_use_is_one_gpuguard_exports() -> None:
    registry = CollectorRegistry()
    Metrics(registry)
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "info": ["_info"]}
    exported = {m.name + x for m in registry.collect() for x in suffixes.get(m.type, [""])}
    used = set(re.findall(r"\bgpuguard_[a-z_]+", " ".join([r["expr"] for r in rules()] + dashboard_exprs())))
    assert used - exported == set()
    assert used >= {
        "gpuguard_node_quarantined",
        "gpuguard_node_quarantine_deferred",
        "gpuguard_gpu_healthy",
        "gpuguard_gpu_xid_watched",
        "gpuguard_gpus_quarantined",
        "gpuguard_gpus_quarantine_deferred",
        "gpuguard_gpu_degraded",
    }
    # The second level (issue 29): an alert and a dashboard panel of their own.
    assert any("gpuguard_gpu_degraded" in e for e in dashboard_exprs())
    assert any(r["alert"] == "GpuguardGPUDegraded" and "gpuguard_gpu_degraded" in r["expr"] for r in rules())


def test_the_dashboard_is_importable_json_with_a_datasource_and_node_variable() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "gpuguard"
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "node"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["datasource"]["uid"] == "${datasource}" for p in doc["panels"] for t in p["targets"])


@pytest.mark.parametrize(
    ("value", "template", "plain"),
    [
        ("monitoring.prometheusRule.enabled", "prometheusrule.yaml", "deploy/monitoring/prometheusrule.yaml"),
        ("monitoring.podMonitor.enabled", "podmonitor.yaml", "deploy/monitoring/podmonitor.yaml"),
        ("networkPolicy.enabled", "networkpolicy.yaml", "deploy/networkpolicy.yaml"),
    ],
)
def test_each_plain_file_is_exactly_the_charts_render(
    helm: Helm, value: str, template: str, plain: str
) -> None:
    rendered = [d for d in helm.render("--set", f"{value}=true") if d["kind"] not in _default_kinds(helm)]
    assert rendered == [yaml.safe_load((ROOT / plain).read_text())]
    assert (ROOT / "deploy" / "helm" / "gpuguard" / "templates" / template).is_file()


def test_the_dashboard_configmap_carries_the_dashboard_file(helm: Helm) -> None:
    docs = helm.render("--set", "monitoring.grafanaDashboard.enabled=true")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["gpuguard.json"]) == json.loads(DASHBOARD.read_text())


def test_the_podmonitor_gives_the_alerts_their_job_and_node_labels() -> None:
    pm = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    assert pm["spec"]["jobLabel"] == "app.kubernetes.io/name"  # job="gpuguard" (GpuguardAgentDown)
    endpoint = pm["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "http"
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint[
        "relabelings"
    ]


def _default_kinds(helm: Helm) -> set[str]:
    return {d["kind"] for d in helm.render()}


# -- runbooks ------------------------------------------------------------------------------------------------

OPERATIONS = ROOT / "docs" / "operations.md"
# The chart's home: the absolute base of every runbook_url unless runbookBaseURL names another.
HOME = yaml.safe_load((ROOT / "deploy" / "helm" / "gpuguard" / "Chart.yaml").read_text())["home"]


def _runbook(alert: str) -> str:
    """The text of docs/operations.md under the heading `### <alert>`."""
    text = OPERATIONS.read_text()
    start = re.search(rf"^### {alert}$", text, re.M)
    assert start, f"docs/operations.md has no heading for {alert}"
    end = re.search(r"^#{2,3} ", text[start.end() :], re.M)
    return text[start.end() : start.end() + (end.start() if end else len(text))]


def test_every_alert_has_a_runbook_url_to_its_own_heading_in_operations_md() -> None:
    for rule in rules():
        alert = rule["alert"]
        assert rule["annotations"].get("runbook_url") == f"{HOME}/docs/operations.md#{alert.lower()}", alert
        assert len(_runbook(alert).split()) > 20, f"{alert}'s runbook says next to nothing"


def test_the_budget_alerts_say_how_to_raise_the_budget_and_their_runbook_shows_it() -> None:
    budget = [r for r in rules() if "BudgetSpent" in r["alert"]]
    assert len(budget) == 2
    for rule in budget:
        assert "budget.maxQuarantined" in rule["annotations"]["description"]
        assert "GPUGUARD_MAX_QUARANTINED" in rule["annotations"]["description"]
    node_runbook = _runbook("GpuguardQuarantineBudgetSpent")
    assert re.search(r"```sh\nhelm upgrade .*--set budget\.maxQuarantined=", node_runbook, re.S)
    assert "GPUGUARD_MAX_QUARANTINED" in node_runbook
    assert "budget.maxQuarantined" in _runbook("GpuguardGPUQuarantineBudgetSpent")


def test_every_runbook_url_is_absolute_the_charts_home_or_the_runbook_base_url(helm: Helm) -> None:
    base = "https://docs.example.com/gpuguard/"
    docs = helm.render(
        "--set", "monitoring.prometheusRule.enabled=true",
        "--set", f"monitoring.prometheusRule.runbookBaseURL={base}",
    )  # fmt: skip
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert urls == [f"{base}docs/operations.md#{r['alert'].lower()}" for r in rules()]
    default = next(d for d in helm.render("--set", "monitoring.prometheusRule.enabled=true")
                   if d["kind"] == "PrometheusRule")  # fmt: skip
    for group in default["spec"]["groups"]:
        for r in group["rules"]:  # absolute: a link in Alertmanager
            assert r["annotations"]["runbook_url"] == f"{HOME}/docs/operations.md#{r['alert'].lower()}"
    bad = helm.run("template", "gpuguard", str(ROOT / "deploy" / "helm" / "gpuguard"), "--set",
                   "monitoring.prometheusRule.runbookBaseURL=not a url")  # fmt: skip
    assert bad.returncode != 0 and "runbookBaseURL" in bad.stderr
