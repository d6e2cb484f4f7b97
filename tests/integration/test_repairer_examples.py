"""The repairer examples gpuguard ships (deploy/examples/node-healthcheck.yaml, node-readiness-rule.yaml,
shown in docs/operations.md) checked against their own CRDs, vendored unchanged under
tests/integration/data/crds/ with their source and release: the real kube-apiserver accepts each example,
and refuses a broken one for the reason its schema gives (so the check can fail)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from harness.kube import ROOT, Admin, eventually

pytestmark = pytest.mark.timeout(120)

CRDS = ROOT / "tests" / "integration" / "data" / "crds"
EXAMPLES = ROOT / "deploy" / "examples"
ApiException = kubernetes.client.exceptions.ApiException


def _one(path: Path) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return doc  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def admin(admin_api: kubernetes.client.ApiClient) -> Admin:
    a = Admin(admin_api)
    ext: Any = kubernetes.client.ApiextensionsV1Api(admin_api)
    for path in sorted(CRDS.glob("*.yaml")):
        crd = _one(path)
        try:
            ext.create_custom_resource_definition(crd)
        except ApiException as exc:
            if exc.status != 409:
                raise

        def established(name: str = crd["metadata"]["name"]) -> bool:
            conditions = ext.read_custom_resource_definition(name).status.conditions or []
            return any(c.type == "Established" and c.status == "True" for c in conditions)

        eventually(established, 30, what=f"CRD {crd['metadata']['name']} Established")
    return a


def _create(admin: Admin, doc: dict[str, Any]) -> None:
    """A server-side dry-run create: the API server validates the object against the CRD's schema and
    CEL rules in full, and stores nothing."""
    group, version = doc["apiVersion"].split("/")
    plural = {"NodeHealthCheck": "nodehealthchecks", "NodeReadinessRule": "nodereadinessrules"}[doc["kind"]]
    custom: Any = kubernetes.client.CustomObjectsApi(admin.api)
    custom.create_cluster_custom_object(group, version, plural, doc, dry_run="All")


def _refused(admin: Admin, doc: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as info:
        _create(admin, doc)
    assert info.value.status == 422, info.value.body
    return str(json.loads(info.value.body or "{}").get("message", ""))


def _broken(doc: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    change(out["spec"])
    return out


def test_the_node_healthcheck_example_is_accepted_by_its_crd_and_a_broken_one_refused(admin: Admin) -> None:
    doc = _one(EXAMPLES / "node-healthcheck.yaml")
    assert {"type": "AcceleratedHardwareReady", "status": "False", "duration": "10m"} in doc["spec"][
        "unhealthyConditions"
    ]
    _create(admin, doc)
    no_status = _broken(doc, lambda s: s["unhealthyConditions"][0].pop("status"))
    assert "status" in _refused(admin, no_status)
    spelled_out = _broken(doc, lambda s: s["unhealthyConditions"][0].update(duration="10 minutes"))
    assert "duration" in _refused(admin, spelled_out)


def test_the_node_readiness_rule_example_is_accepted_by_its_crd_and_a_broken_one_refused(
    admin: Admin,
) -> None:
    doc = _one(EXAMPLES / "node-readiness-rule.yaml")
    assert doc["spec"]["enforcementMode"] == "continuous"
    assert doc["spec"]["conditions"] == [{"type": "GPUHealthy", "requiredStatus": "True"}]
    _create(admin, doc)
    ours = _broken(doc, lambda s: s["taint"].update(key="gpuguard.io/unverified"))
    assert "readiness.k8s.io/" in _refused(admin, ours)  # the controller manages only its own prefix
    always = _broken(doc, lambda s: s.update(enforcementMode="always"))
    assert "enforcementMode" in _refused(admin, always)
