"""The `DeviceSource`s: `KubeDeviceSource` (ResourceSlices and DeviceTaintRules of resource.k8s.io/v1 on
the API server, through `gpuguard.kube.client`, which raises gpuguard's errors itself) and
`DryRunDeviceSource`
(reads the real slices where a cluster is named, writes nothing: logs the exact rule and keeps it in memory).
`make_device_source` is the one place that knows which one a setting asks for."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import structlog

from gpuguard.core.config import NodeSettings
from gpuguard.core.errors import GpuguardError, PermanentApiError
from gpuguard.core.metrics import Metrics, counted
from gpuguard.kube import client as kubeclient
from gpuguard.kube import devicerules, kubeconfig
from gpuguard.quarantine.gpu.degraded import is_degraded_rule
from gpuguard.quarantine.gpu.rules import (
    LABEL_MANAGED_BY,
    LABEL_NODE,
    LIST_PAGE,
    MANAGED_BY,
    DeviceRule,
    trim_rule,
)
from gpuguard.quarantine.record import ANN_REASON, ANN_SINCE

log = structlog.get_logger(__name__)
T = TypeVar("T")

EVERY_NODE = f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_NODE}"
"""The label selector of gpuguard's rules of every node (what the budget reads; `gpu.watch` watches it)."""
RULES_API_UNKNOWN = "unknown"
"""`api_version` before the first list of rules."""
RULES_API_NONE = "none"
"""`api_version` when the last list found DeviceTaintRules in no version: per-GPU faults get the node
taint."""


class KubeDeviceSource:
    """One node's ResourceSlices (field selectors spec.nodeName and spec.driver: only this node's, of the
    driver) and gpuguard's DeviceTaintRules for it (label selector gpuguard.io/node)."""

    def __init__(
        self,
        node: str,
        *,
        api: kubeclient.Client,
        driver: str,
        timeout: float = 10.0,
        metrics: Metrics | None = None,
        announce: bool = False,
    ) -> None:
        """announce: log what the lists find (device.rules_api), for the agent; not for `gpuguard status`
        and `uninstall`, whose stdout is their answer."""
        self._node = node
        self._announce = announce
        self._api = api
        self._driver = driver
        self._timeout = timeout
        self._metrics = metrics
        self._rule_version = devicerules.VERSIONS[0]
        self._version_known = False
        self._api_version = RULES_API_UNKNOWN

    @property
    def api_version(self) -> str:
        """Where this API server serves DeviceTaintRules, as the first list found it: "resource.k8s.io/v1"
        or "resource.k8s.io/v1beta2"; RULES_API_NONE (neither: every fault gets the node taint) or
        RULES_API_UNKNOWN (not listed yet). /healthz reports it as device_taint_api."""
        return self._api_version

    @property
    def api(self) -> kubeclient.Client:
        return self._api

    @property
    def rules_path(self) -> str | None:
        """The rules' collection path once a list found the version served; None before, or where none is
        (gpu.watch.WatchedRules watches it)."""
        return devicerules.rules_path(self._rule_version) if self._version_known else None

    def slices(self) -> list[dict[str, Any]] | None:
        """None where no resource.k8s.io/v1 is served (Kubernetes < 1.34, or DRA off): no slices."""
        return self._unless_absent(
            "list",
            lambda: devicerules.slices(
                self._api, node=self._node, driver=self._driver, timeout=self._timeout
            ),
        )

    def rules(self) -> list[DeviceRule]:
        return self._list(f"{LABEL_NODE}={self._node},{LABEL_MANAGED_BY}={MANAGED_BY}")

    def all_rules(self, *, whole: bool = False) -> list[DeviceRule]:
        """Every node's gpuguard rules, kept as far as the budget reads them; `whole`: all of each (for
        `gpuguard status`, which shows their records)."""
        return self._list(EVERY_NODE, trim=not whole)

    def _list(self, selector: str, *, trim: bool = False) -> list[DeviceRule]:
        """In pages of LIST_PAGE (a node's own rules too: the policy bounds each rule, not how many a stolen
        token makes); `trim`: each kept only as far as the budget reads it (`rules.trim_rule`)."""
        versions = (self._rule_version,) if self._version_known else devicerules.VERSIONS
        for version in versions:
            self._rule_version = version
            found: list[DeviceRule] = []
            after: str | None = None
            try:
                while True:
                    with self._counted("list"):
                        doc = devicerules.list_page(
                            self._api,
                            version,
                            selector=selector,
                            limit=LIST_PAGE,
                            after=after,
                            timeout=self._timeout,
                        )
                    found += [
                        DeviceRule.from_api(trim_rule(d) if trim else d) for d in doc.get("items") or []
                    ]
                    token = (doc.get("metadata") or {}).get("continue")
                    if not token:
                        break
                    after = str(token)
            except PermanentApiError as exc:
                if exc.status == 404:
                    continue  # not served in this version
                raise
            self._version_known = True
            self._found(devicerules.api_version(version))
            return found
        # Served in no version: a create answers 404, and the node taint stands in (device.rule_rejected).
        # The next list (the next read) asks both versions again: a cluster may turn the API on meanwhile.
        self._rule_version = devicerules.VERSIONS[0]
        self._found(RULES_API_NONE)
        return []

    def _found(self, api_version: str) -> None:
        """One line when what the lists find changes (at the first list, as a rule, and never per list)."""
        if api_version == self._api_version:
            return
        self._api_version = api_version
        if not self._announce:
            return
        tried = [devicerules.api_version(v) for v in devicerules.VERSIONS]
        if api_version == RULES_API_NONE:
            log.warning(
                "device.rules_api",
                node=self._node or None,
                api_version=None,
                tried=tried,
                note="DeviceTaintRules are not served: faults of one GPU get the node taint",
            )
            return
        log.info(
            "device.rules_api",
            node=self._node or None,
            api_version=api_version,
            tried=tried[: tried.index(api_version) + 1],
            note="faults of one GPU published in a ResourceSlice get a DeviceTaintRule",
        )

    def create(self, body: Mapping[str, Any]) -> DeviceRule:
        with self._counted("create"):
            doc = devicerules.create(self._api, self._rule_version, body, timeout=self._timeout)
        return DeviceRule.from_api(doc)

    def get(self, name: str) -> DeviceRule | None:
        doc = self._unless_absent(
            "get", lambda: devicerules.get(self._api, self._rule_version, name, timeout=self._timeout)
        )
        return DeviceRule.from_api(doc) if doc is not None else None

    def patch(self, rule: DeviceRule, body: Mapping[str, Any]) -> DeviceRule:
        with self._counted("patch"):
            doc = devicerules.patch(self._api, self._rule_version, rule.name, body, timeout=self._timeout)
        return DeviceRule.from_api(doc)

    def delete(self, rule: DeviceRule) -> None:
        """A rule already gone (404) is what recovery wanted."""
        self._unless_absent(
            "delete",
            lambda: devicerules.delete(
                self._api,
                self._rule_version,
                rule.name,
                uid=rule.uid,
                resource_version=rule.resource_version,
                timeout=self._timeout,
            ),
        )

    def _unless_absent(self, verb: str, call: Callable[[], T]) -> T | None:
        """`call()`, one request counted with its answer; None where the API server has none (404)."""
        try:
            with self._counted(verb):
                return call()
        except PermanentApiError as exc:
            if exc.status == 404:
                return None
            raise

    def _counted(self, verb: str) -> AbstractContextManager[None]:
        return counted(self._metrics, verb)


class DryRunDeviceSource:
    """Writes nothing: logs the rule it would create, change or delete, and keeps it in memory. Reads the
    real slices where a cluster was named (so a dry run on a live cluster takes the real decisions), else
    sees none (every fault then plans the node taint, as on a device-plugin cluster)."""

    def __init__(self, real: KubeDeviceSource | None) -> None:
        self._real = real
        self._rules: dict[str, DeviceRule] = {}
        self._version = 0

    def slices(self) -> list[dict[str, Any]] | None:
        if self._real is None:
            return None
        try:
            return self._real.slices()
        except GpuguardError as exc:
            log.warning("device.dry_run_without_slices", error=str(exc))
            return None

    @property
    def api_version(self) -> str | None:
        """The real source's (None without a cluster: not looked for)."""
        return self._real.api_version if self._real is not None else None

    def rules(self) -> list[DeviceRule]:
        if self._real is not None and self._real.api_version == RULES_API_UNKNOWN:
            # Which version the real server serves, if any, so the dry run decides as the agent would.
            try:
                self._real.rules()
            except GpuguardError as exc:
                log.warning("device.dry_run_without_rules_api", error=str(exc))
        return list(self._rules.values())

    def all_rules(self) -> list[DeviceRule]:
        return list(self._rules.values())

    def get(self, name: str) -> DeviceRule | None:
        return self._rules.get(name)

    def create(self, body: Mapping[str, Any]) -> DeviceRule:
        if self._real is not None and self._real.api_version == RULES_API_NONE:
            # What the server would answer (404): the dry run plans the node taint, as the agent would.
            raise PermanentApiError("DeviceTaintRules are not served (dry run)", status=404)
        log.info("device.dry_run", action="create", rule=body["metadata"]["name"], body=dict(body))
        return self._keep(body)

    def patch(self, rule: DeviceRule, body: Mapping[str, Any]) -> DeviceRule:
        log.info("device.dry_run", action="patch", rule=rule.name, patch=dict(body))
        meta = body.get("metadata") or {}
        annotations = {**rule.annotations, **(meta.get("annotations") or {})}
        effect = ((body.get("spec") or {}).get("taint") or {}).get("effect", rule.effect)
        doc = {
            "metadata": {
                "name": rule.name,
                "labels": dict(rule.labels),
                "annotations": {k: v for k, v in annotations.items() if v is not None},
            },
            "spec": {
                "deviceSelector": {"driver": rule.driver, "pool": rule.pool, "device": rule.device},
                "taint": {"key": rule.key, "effect": effect},
            },
        }
        return self._keep(doc)

    def delete(self, rule: DeviceRule) -> None:
        log.info("device.dry_run", action="delete", rule=rule.name)
        self._rules.pop(rule.name, None)

    def _keep(self, doc: Mapping[str, Any]) -> DeviceRule:
        self._version += 1
        meta = {**doc["metadata"], "resourceVersion": str(self._version), "uid": "dry-run"}
        rule = DeviceRule.from_api({**doc, "metadata": meta})
        self._rules[rule.name] = rule
        return rule


def make_device_source(
    settings: NodeSettings, connect: Callable[[], kubeclient.Client], metrics: Metrics | None = None
) -> KubeDeviceSource | DryRunDeviceSource:
    """The source the settings ask for: the API server (through the agent's one client, `connect()`, the
    node writer's), or a dry run."""
    if settings.dry_run:
        return _dry_run(settings, connect)
    assert settings.name is not None  # validated
    driver, timeout = settings.dra_driver, settings.api_timeout
    return KubeDeviceSource(
        settings.name, api=connect(), driver=driver, timeout=timeout, metrics=metrics, announce=True
    )


def _dry_run(settings: NodeSettings, connect: Callable[[], kubeclient.Client]) -> DryRunDeviceSource:
    """A dry run reads the real slices where a cluster is named, as `node.writers.make_writer` reads the
    real node."""
    real = None
    if settings.name and kubeconfig.named(settings.kubeconfig):
        try:
            api = connect()
        except GpuguardError as exc:
            log.warning("device.dry_run_without_cluster", error=str(exc))
        else:
            real = KubeDeviceSource(
                settings.name, api=api, driver=settings.dra_driver, timeout=3.0, announce=True
            )
    return DryRunDeviceSource(real)


def quarantined_gpus(api: kubeclient.Client, *, timeout: float = 10.0) -> list[dict[str, Any]]:
    """For `gpuguard status`: every GPU gpuguard holds out with a DeviceTaintRule (one list request; none
    where the API server serves no DeviceTaintRules). Rows shaped like `writers.quarantined_nodes`'s, plus the
    device and the GPU's UUID."""
    source = KubeDeviceSource("", api=api, driver="", timeout=timeout)
    rows: list[dict[str, Any]] = []
    for rule in source.all_rules(whole=True):
        rows.append(
            {
                "node": rule.pool,
                "device": rule.device,
                "uuid": rule.uuid,
                "state": "gpu-degraded"
                if is_degraded_rule(rule)
                else "gpu-deferred"
                if rule.deferred
                else "gpu-quarantined",
                "reason": rule.record.primary_reason,
                "effect": rule.effect,
                "since": rule.annotations.get(ANN_SINCE),
                "faults": sorted(rule.faults),
                "detail": rule.annotations.get(ANN_REASON),
                "cordoned_by_gpuguard": False,
                "unschedulable": False,
                "degraded": sorted(rule.faults) if is_degraded_rule(rule) else [],
                # A held repeat offender's rule records it (its primary reason); the counts are on its node.
                "repeat_offenders": {},
            }
        )
    return sorted(rows, key=lambda r: (str(r["node"]), str(r["device"])))
