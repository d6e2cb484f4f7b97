"""What `gpuguard check` and `gpuguard status` print: a verdict and the quarantined nodes, as a table or as
JSON. Pure: values in, text out."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gpuguard.core.model import REPEAT_OFFENDER, AgentStatus, Verdict, plural
from gpuguard.runtime.health import health_body, unhealthy_count


def verdict_table(verdict: Verdict) -> str:
    """The GPUs, with their faults (REASONS) and degraded signals (DEGRADED: the second level, shown, not a
    fault); the node's own below; the last line says healthy or UNHEALTHY with how many GPUs of how many are
    unhealthy, and how many are degraded."""
    rows: list[tuple[str, ...]] = [("GPU", "UUID", "NAME", "HEALTHY", "ECC", "DEGRADED", "REASONS")]
    for g in verdict.gpus:
        ecc = "n/a" if g.ecc_uncorrected is None else str(g.ecc_uncorrected)
        reasons = "; ".join(f.message for f in g.faults) or "-"
        degraded = ",".join(sorted({f.reason for f in g.degraded})) or "-"
        rows.append(
            (str(g.index), g.uuid, g.name or "-", "yes" if g.healthy else "NO", ecc, degraded, reasons)
        )
    lines = _aligned(rows)
    lines += [f"node: {f.message}" for f in verdict.node_faults]
    lines += [f"node degraded: {f.message}" for f in verdict.node_degraded]
    lines += [f"GPU {g.index} degraded: {f.message}" for g in verdict.gpus for f in g.degraded]
    last = "healthy" if verdict.healthy else f"UNHEALTHY: {unhealthy_count(verdict)}"
    degraded_gpus = sum(1 for g in verdict.gpus if g.degraded)
    if verdict.degraded:
        last += f", {plural(degraded_gpus, 'GPU')} degraded" if degraded_gpus else ", the node degraded"
    lines.append(last)
    return "\n".join(lines)


def verdict_json(verdict: Verdict) -> str:
    """The GPUs exactly as /healthz shows them, plus the node's own reasons."""
    status = AgentStatus(
        alive=True,
        ready=True,
        node=None,
        verdict=verdict,
        tainted=False,
        cordoned=False,
        dry_run=True,
        last_check=None,
    )
    body = {
        "healthy": verdict.healthy,
        "gpus": health_body(status)["gpus"],
        "node_reasons": [f.message for f in verdict.node_faults],
        "node_degraded": [f.message for f in verdict.node_degraded],
    }
    return json.dumps(body, indent=2)


def status_table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "no node or GPU is quarantined or degraded by gpuguard"
    header = (
        *("NODE", "STATE", "REASON", "SINCE", "CORDONED", "FAULTS"),
        *("DEGRADED", "REPEAT-OFFENDERS", "DETAIL"),
    )
    table: list[tuple[str, ...]] = [header]
    for r in rows:
        cordon = "gpuguard" if r["cordoned_by_gpuguard"] else ("other" if r["unschedulable"] else "no")
        table.append(
            (
                r["node"] + (f" {r['device']}" if r.get("device") else ""),
                r["state"],
                r["reason"] or "-",
                r["since"] or "-",
                cordon,
                ",".join(r["faults"]) or "-",
                ",".join(r.get("degraded") or ()) or "-",
                _repeat(r),
                r["detail"] or "-",
            )
        )
    return "\n".join([*_aligned(table), *_budget_note(rows)])


def _repeat(row: Mapping[str, Any]) -> str:
    """The GPUs held for repair and their fault episodes (`UUID=3`), or `held` for a GPU's own rule."""
    held = row.get("repeat_offenders") or {}
    if held:
        return ",".join(f"{uuid}={n}" for uuid, n in sorted(held.items()))
    return "held" if row["reason"] == REPEAT_OFFENDER else "-"


def _budget_note(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Whether repeat offenders spend the quarantine budget: held nodes count like any quarantined one."""
    full = [r for r in rows if r["state"] == "quarantined"]
    held = [r for r in full if r.get("repeat_offenders") or r["reason"] == REPEAT_OFFENDER]
    if not held:
        return []
    return [
        f"{len(held)} of {len(full)} fully quarantined nodes are held as repeat offenders (label "
        "gpuguard.io/needs-repair): they spend the --max-quarantined budget until repaired and released "
        "(`gpuguard release --node NAME`)"
    ]


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Every column but the last padded to its widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
