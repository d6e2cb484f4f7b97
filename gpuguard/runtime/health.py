"""The /healthz body: what the agent knows, as JSON (the contract is the README's /healthz section). Pure: the
HTTP server (server.py) sends it, `gpuguard status -o json` (report.py) shows its GPUs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gpuguard.core.model import AgentStatus, Verdict, plural


def health_body(s: AgentStatus) -> dict[str, Any]:
    """The /healthz JSON contract (exactly these keys)."""
    v = s.verdict
    return {
        "agent": "ok" if s.alive else "stalled",
        "node": s.node,
        "healthy": v.healthy if v is not None else False,
        # Faults of the node itself (nvml-init, gpu-missing, an Xid NVML could not attribute, a hung call).
        "node_reasons": [f.message for f in v.node_faults] if v is not None else [],
        # Degraded signals of the node itself (the second level, `degraded`), as each GPU's `degraded`.
        "node_degraded": [f.message for f in v.node_degraded] if v is not None else [],
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "healthy": g.healthy,
                "reasons": [f.message for f in g.faults],
                # The second level: signals that make the GPU degraded (shown and scheduled around
                # softly, never a quarantine; `healthy` ignores them).
                "degraded": [f.message for f in g.degraded],
                # False while the agent is not registered for this GPU's Xid events (see xid_watch_note).
                "xid_watched": g.xid_watched,
                # A row remap waiting for a GPU reset (null where the GPU does not remap rows): shown only.
                "row_remap_pending": g.remap_pending,
            }
            for g in (v.gpus if v is not None else ())
        ],
        "tainted": s.tainted,
        "cordoned": s.cordoned,
        # GPUs held out by DRA DeviceTaintRules (the per-GPU quarantine); the node itself stays in service.
        "gpu_quarantines": [
            {
                "uuid": q.uuid,
                "device": q.device,
                "rule": q.rule,
                "reason": q.reason,
                "effect": q.effect,
                "deferred": q.deferred,
            }
            for q in s.gpu_quarantines
        ],
        # Where DeviceTaintRules are served (see AgentStatus.device_taint_api); "none": the node taint.
        "device_taint_api": s.device_taint_api,
        # NVML calls that have not returned within their deadline, one stuck thread each.
        "nvml_stuck_calls": list(s.nvml_stuck_calls),
        # The API server as the agent last met it: ok | unreachable | refused, since when (null: since the
        # start), the last error; null in a dry run (no API server).
        "api": None
        if s.api is None
        else {"state": s.api.state, "since": _time(s.api.since), "error": s.api.error},
        "dry_run": s.dry_run,
        "last_check": _time(s.last_check),
    }


def _time(when: datetime | None) -> str | None:
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z") if when else None


def unhealthy_count(verdict: Verdict) -> str:
    """How many GPUs are unhealthy, of how many ("2 of 8 GPUs unhealthy"), and the node's own faults."""
    bad = sum(1 for g in verdict.gpus if not g.healthy)
    text = f"{bad} of {plural(len(verdict.gpus), 'GPU')} unhealthy"
    if verdict.node_faults:
        text += f", the node: {', '.join(sorted({f.reason for f in verdict.node_faults}))}"
    return text


def dry_run_summary(s: AgentStatus) -> str:
    """The last line of a dry run (the demo): what gpuguard would have done by the end; it wrote nothing."""
    would = []
    if s.tainted:
        would.append(f"{'taint and cordon' if s.cordoned else 'taint'} node {s.node or 'dry-run'}")
    if s.gpu_quarantines:
        would.append(f"hold out {plural(len(s.gpu_quarantines), 'GPU')} with DeviceTaintRules")
    gpus = unhealthy_count(s.verdict) if s.verdict is not None else "no check completed"
    return f"would {' and '.join(would) or 'change nothing'} ({gpus}); wrote nothing"
