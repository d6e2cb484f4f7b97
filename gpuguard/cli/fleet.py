"""`gpuguard status`'s fleet at a glance, pure: from the nodes, gpuguard's DaemonSets and their pods as the
API server lists them, and the rows of what gpuguard holds, how many GPU nodes there are, how many have a
ready agent and which have none, the quarantine budget used against its limit, and how many nodes are gated,
quarantined, degraded and held as repeat offenders; in one line first, then the nodes without an agent.

A GPU node: a node one of gpuguard's DaemonSets selects (its nodeSelector and required node affinity), or one
with `nvidia.com/gpu` capacity (an agent whose selector matches no GPU node fails silently otherwise). The
budget's limit is the DaemonSet's --max-quarantined (args, else env GPUGUARD_MAX_QUARANTINED, else the
default) of the nodes its --gpu-node-selector selects, as each agent counts it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuguard.core.config import DEFAULT_MAX_QUARANTINED, GPU_NODE_SELECTOR, NodeSettings, QuarantineLimit
from gpuguard.core.errors import ConfigError
from gpuguard.core.model import plural

GPU_RESOURCE = "nvidia.com/gpu"
# The nodes without an agent named in the table's note; the JSON lists them all.
NAMED = 10


@dataclass(frozen=True)
class Agents:
    """What one of gpuguard's DaemonSets says: whom it selects and the settings the fleet view needs."""

    name: str
    node_selector: dict[str, str]
    affinity: list[list[dict[str, Any]]]  # required terms (ORed), each a list of match expressions (ANDed)
    max_quarantined: str
    gpu_node_selector: str
    gate_taint_key: str

    def selects(self, labels: Mapping[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in self.node_selector.items()):
            return False
        return not self.affinity or any(all(_matches(e, labels) for e in term) for term in self.affinity)


@dataclass(frozen=True)
class Fleet:
    gpu_nodes: int
    agents_ready: int
    without_agent: list[str]
    budget_used: int
    budget_limit: int | None  # None: --max-quarantined unreadable (a value from a Secret, say)
    budget_text: str
    gated: list[str]
    quarantined: int
    gpus_quarantined: int
    degraded: int
    repeat_offenders: int
    selects_nothing: list[str] = field(default_factory=list)  # DaemonSets whose selection matches no node

    def summary(self) -> str:
        limit = "?" if self.budget_limit is None else str(self.budget_limit)
        return (
            f"{plural(self.gpu_nodes, 'GPU node')}, {self.agents_ready} with a ready agent, "
            f"{len(self.without_agent)} without; budget {self.budget_used} of {limit} "
            f"(--max-quarantined {self.budget_text}); {len(self.gated)} gated, "
            f"{self.quarantined} quarantined, {plural(self.gpus_quarantined, 'GPU')} quarantined alone, "
            f"{self.degraded} degraded, "
            f"{plural(self.repeat_offenders, 'repeat offender')}"
        )

    def notes(self) -> list[str]:
        out = []
        if self.without_agent:
            names = ", ".join(self.without_agent[:NAMED])
            more = f" and {len(self.without_agent) - NAMED} more" if len(self.without_agent) > NAMED else ""
            out.append(f"GPU nodes without a ready agent: {names}{more}")
        if self.gated:
            out.append(f"gated (startup taint, not yet checked): {', '.join(self.gated[:NAMED])}")
        out += [f"the DaemonSet {d} selects no node: its agents run nowhere" for d in self.selects_nothing]
        return out

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def agents_of(daemonset: Mapping[str, Any]) -> Agents:
    meta = daemonset.get("metadata") or {}
    pod = ((daemonset.get("spec") or {}).get("template") or {}).get("spec") or {}
    affinity = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = [list(t.get("matchExpressions") or []) for t in affinity.get("nodeSelectorTerms") or []]
    container: Mapping[str, Any] = next(iter(pod.get("containers") or []), {})
    defaults = NodeSettings()
    return Agents(
        name=f"{meta.get('namespace', '')}/{meta.get('name', '')}",
        node_selector={str(k): str(v) for k, v in (pod.get("nodeSelector") or {}).items()},
        affinity=terms,
        max_quarantined=_setting(container, "max-quarantined", DEFAULT_MAX_QUARANTINED.text),
        gpu_node_selector=_setting(container, "gpu-node-selector", GPU_NODE_SELECTOR),
        gate_taint_key=_setting(container, "gate-taint-key", defaults.gate_taint_key),
    )


def fleet(
    nodes: Sequence[Mapping[str, Any]],
    daemonsets: Sequence[Agents],
    pods: Sequence[Mapping[str, Any]],
    rows: Sequence[Mapping[str, Any]],
) -> Fleet:
    """The fleet view from what the API server listed (nodes, DaemonSets, pods) and `status`'s rows."""
    labels = {_name(n): _labels(n) for n in nodes}
    gpu = sorted(
        name
        for name, node in zip(labels, nodes, strict=True)
        if any(d.selects(labels[name]) for d in daemonsets) or _gpus(node) > 0
    )
    ready = {str((p.get("spec") or {}).get("nodeName")) for p in pods if _ready(p)}
    first = daemonsets[0] if daemonsets else None
    budget_text = first.max_quarantined if first else DEFAULT_MAX_QUARANTINED.text
    counted = [
        n for n in labels if _selected(first.gpu_node_selector if first else GPU_NODE_SELECTOR, labels[n])
    ]
    try:
        limit: int | None = QuarantineLimit.parse(budget_text).of(len(counted))
    except ConfigError:
        limit = None
    gate = first.gate_taint_key if first else NodeSettings().gate_taint_key
    node_rows = [r for r in rows if not r.get("device")]
    return Fleet(
        gpu_nodes=len(gpu),
        agents_ready=sum(1 for n in gpu if n in ready),
        without_agent=[n for n in gpu if n not in ready],
        budget_used=sum(1 for n in counted if labels[n].get("gpuguard.io/quarantined") == "true"),
        budget_limit=limit,
        budget_text=budget_text,
        gated=sorted(_name(n) for n in nodes if any(t.get("key") == gate for t in _taints(n))),
        quarantined=sum(1 for r in node_rows if r["state"] in ("quarantined", "deferred")),
        gpus_quarantined=sum(1 for r in rows if r.get("state") in ("gpu-quarantined", "gpu-deferred")),
        degraded=len({r["node"] for r in rows if r.get("degraded")}),
        repeat_offenders=sum(len(r.get("repeat_offenders") or {}) for r in node_rows),
        selects_nothing=[d.name for d in daemonsets if not any(d.selects(v) for v in labels.values())],
    )


def _setting(container: Mapping[str, Any], flag: str, default: str) -> str:
    """A flag's value as the container passes it: in args (`--flag v` or `--flag=v`), else in its env
    variable; a value from elsewhere (valueFrom) is not known here."""
    args = [str(a) for a in container.get("args") or []]
    for i, arg in enumerate(args):
        if arg == f"--{flag}" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(f"--{flag}="):
            return arg.split("=", 1)[1]
    env = f"GPUGUARD_{flag.upper().replace('-', '_')}"
    for var in container.get("env") or []:
        if var.get("name") == env and "value" in var:
            return str(var["value"])
    return default


def _matches(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op, values = str(expr.get("key")), expr.get("operator"), expr.get("values") or []
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    return False  # Gt, Lt and what this does not know: not selected, rather than counted wrongly


def _selected(selector: str, labels: Mapping[str, str]) -> bool:
    """--gpu-node-selector's syntax: alternatives separated by ";" (any may match), each
    key[=value][,key[=value]] (all must; a bare key: the label exists); "" selects every node."""

    def term(t: str) -> bool:
        key, eq, value = t.partition("=")
        return key in labels and (not eq or labels[key] == value)

    return any(all(term(t) for t in alt.split(",") if t) for alt in selector.split(";"))


def _name(node: Mapping[str, Any]) -> str:
    return str((node.get("metadata") or {}).get("name", ""))


def _labels(node: Mapping[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in ((node.get("metadata") or {}).get("labels") or {}).items()}


def _taints(node: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [t for t in (node.get("spec") or {}).get("taints") or [] if isinstance(t, dict)]


def _gpus(node: Mapping[str, Any]) -> int:
    value = ((node.get("status") or {}).get("capacity") or {}).get(GPU_RESOURCE, "0")
    return int(value) if str(value).isdigit() else 0


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
