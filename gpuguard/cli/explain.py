"""`gpuguard explain`: why a node or a GPU was taken, and what would clear it (docs/design.md, "Evidence at
detection").

On the node it reads the evidence kept in --state-dir (gpuguard.store.evidence): the timeline of each
fault and degraded mark as first judged, with what made it. From a laptop, `--node N` reads what the node
carries on the API server: gpuguard's annotations and taints, its DeviceTaintRules and its Events (the
evidence file stays on the node). Either way each reason comes with the rule that fired (the Xid catalog's
bucket, a signal's threshold) and what would clear it (gpuguard.judge.explained). Output a person reads
first; `-o json` for a ticket. Exit 0; 2 a usage error or an evidence file that cannot be read; 4 the API
server is unreachable or refused the request.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import click

from gpuguard.cli.cluster import _api_failed, _printable, node_client
from gpuguard.cli.commands import EXIT_OK, cli
from gpuguard.cli.flags import FLAGS
from gpuguard.core.config import STATE_DIR, PolicySettings
from gpuguard.core.errors import ConfigError, GpuguardError
from gpuguard.judge.explained import clears, rule

_POLICY = PolicySettings()
WIDTH = 100
"""Columns of the human form: a terminal's, and a ticket's."""


@cli.command()
@FLAGS["kubeconfig"].option()
@click.option(
    "--node", default=None, help="Explain this node from the API server (default: this node's state)."
)
@click.option(
    "--state-dir", default=STATE_DIR, show_default=True, help="The agent's --state-dir, on the node."
)
@click.option("--gpu", default=None, help="Only this GPU: its UUID or index.")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
def explain(kubeconfig: str | None, node: str | None, state_dir: str, gpu: str | None, output: str) -> int:
    """Why a node's GPUs were taken: the timeline of each fault with its evidence, the rule that fired and
    what would clear it. On the node it reads --state-dir; with --node, what the node carries on the API
    server."""
    if node is None:
        doc = local(Path(state_dir), gpu=gpu)
    else:
        api = node_client("explain", kubeconfig, node)
        try:
            doc = remote(api, node, gpu=gpu)
        except GpuguardError as exc:
            return _api_failed("explain", api, exc)
    doc = _printable(doc)
    click.echo(json.dumps(doc, indent=2) if output == "json" else text(doc), nl=output == "json")
    return EXIT_OK


def local(state_dir: Path, *, gpu: str | None) -> dict[str, Any]:
    """The node's own evidence, as `explain` shows it."""
    from gpuguard.store.evidence import FILE_NAME, read  # noqa: PLC0415

    path = state_dir / FILE_NAME
    try:
        records = read(path)
    except ConfigError as exc:
        raise ConfigError(f"explain: {exc}") from None
    timeline = [_why(r) for r in records if _matches(gpu, r.get("uuid"), r.get("gpu"))]
    node = next((str(r["node"]) for r in reversed(records) if r.get("node")), None)
    return {"node": node, "source": str(path), "timeline": timeline}


def remote(api: Any, name: str, *, gpu: str | None) -> dict[str, Any]:
    """What the node carries on the API server, as `explain` shows it."""
    from gpuguard.kube import events, nodes  # noqa: PLC0415
    from gpuguard.quarantine.gpu.writers import quarantined_gpus  # noqa: PLC0415
    from gpuguard.quarantine.record import ANN_FAULTS, ANN_REASON, ANN_SINCE, DOMAIN  # noqa: PLC0415

    obj = nodes.read(api, name) or {}
    meta = obj.get("metadata") or {}
    annotations = {k: str(v) for k, v in (meta.get("annotations") or {}).items()}
    taints = [
        t for t in (obj.get("spec") or {}).get("taints") or () if str(t.get("key", "")).startswith(DOMAIN)
    ]
    held = []
    for key in filter(None, annotations.get(ANN_FAULTS, "").split(",")):
        reason, _, uuid = key.partition("/")
        if _matches(gpu, uuid or None, None):
            held.append(_why({"key": key, "reason": reason, "uuid": uuid or None}))
    rules = [r for r in quarantined_gpus(api) if r.get("node") == name and _matches(gpu, r.get("uuid"), None)]
    timeline = [
        {
            "at": e.get("lastTimestamp") or e.get("eventTime"),
            "type": e.get("type"),
            "event": e.get("reason"),
            "message": e.get("message"),
        }
        for e in events.about_node(api, name)
        if gpu is None or gpu in str(e.get("message", ""))
    ]
    return {
        "node": name,
        "source": "the API server",
        "since": annotations.get(ANN_SINCE),
        "reason": annotations.get(ANN_REASON),
        "taints": [  # as kubectl writes a taint: key[=value]:effect
            f"{t.get('key')}{'=' + str(t['value']) if t.get('value') else ''}:{t.get('effect')}"
            for t in taints
        ],
        "faults": held,
        "gpu_rules": [
            {"uuid": r.get("uuid"), "state": r.get("state"), "faults": r.get("faults")} for r in rules
        ],
        "timeline": timeline,
        "note": "the evidence itself is kept on the node: `gpuguard explain` there (kubectl exec, its agent)",
    }


def _why(r: dict[str, Any]) -> dict[str, Any]:
    reason = str(r.get("reason", ""))
    signals, threshold = _POLICY.signals, _POLICY.ecc_threshold
    return {**r, "rule": r.get("rule") or rule(reason, signals=signals, ecc_threshold=threshold)} | {
        "clears": clears(reason, signals=signals)
    }


def _matches(gpu: str | None, uuid: object, index: object) -> bool:
    return gpu is None or gpu == uuid or (gpu.isdigit() and index == int(gpu))


def text(doc: dict[str, Any]) -> str:
    """The human form: the node, then one block per entry, the reason first."""
    lines = [f"node {doc.get('node') or '(unnamed)'}, from {doc['source']}"]
    if "faults" in doc:  # what the node carries
        lines.append(f"  taints: {', '.join(doc['taints']) or 'none of gpuguard'}")
        if doc.get("since"):
            lines.append(f"  since:  {doc['since']}")
        for r in doc["gpu_rules"]:
            lines.append(f"  GPU {r['uuid']}: {r['state']} ({', '.join(r['faults'] or [])})")
        lines.append("")
        lines.append("faults held now:" if doc["faults"] else "no fault held now")
        for f in doc["faults"]:
            lines.extend(_block(f, f"  {f['key']}"))
        lines.append("")
        lines.append("events:" if doc["timeline"] else "no events of gpuguard about the node")
        lines.extend(f"  {e['at']}  {e['type']} {e['event']}: {e['message']}" for e in doc["timeline"])
        lines.append("")
        lines.append(f"({doc['note']})")
        return "\n".join(_wrapped(lines)) + "\n"
    if not doc["timeline"]:
        lines.append("no evidence recorded")
    for r in doc["timeline"]:
        lines.append("")
        where = f"GPU {r['gpu']} {r['uuid']}" if r.get("uuid") else "the node"
        lines.extend(
            _block(r, f"{r.get('at')}  {r.get('kind')} on {where}: {r['reason']}: {r.get('detail')}")
        )
    return "\n".join(_wrapped(lines)) + "\n"


def _wrapped(lines: list[str]) -> list[str]:
    """Each line within WIDTH columns, a continuation under its label's text; the heading (the node and
    where it was read: a path is copied whole) is never wrapped."""
    out = lines[:1]
    for line in lines[1:]:
        label = len(line) - len(line.lstrip()) + (10 if line.startswith("    ") else 2)
        out.extend(textwrap.wrap(line, WIDTH, subsequent_indent=" " * label, break_on_hyphens=False) or [""])
    return out


def _block(r: dict[str, Any], head: str) -> list[str]:
    out = [head, f"    rule:     {_rule_text(r['rule'])}", f"    clears:   {r['clears']}"]
    for x in r.get("xids") or ():
        said = f": {x.get('process')} (pid {x.get('pid')}) {x.get('text')}" if x.get("pid") else ""
        out.append(f"    xid:      {x.get('code')} from {x.get('source')}{said}")
    out.extend(f"    kernel:   {line}" for line in r.get("kernel") or ())
    if r.get("readings"):
        out.append(
            "    readings: " + ", ".join(f"{k}={v}" for k, v in r["readings"].items() if v is not None)
        )
    if "pods" in r:
        pods = r["pods"]
        out.append(
            f"    pods:     {', '.join(pods) or 'none'}" if pods is not None else "    pods:     unknown"
        )
    if r.get("action"):
        a = r["action"]
        out.append(f"    action:   quarantine {a.get('quarantine')}, effect {a.get('taint_effect')}")
    if r.get("budget"):
        b = r["budget"]
        limit, deferred = b.get("max_quarantined"), b.get("node_deferred")
        out.append(f"    budget:   --max-quarantined {limit}, node deferred: {deferred}")
    if r.get("agent"):
        out.append(f"    agent:    {r['agent'].get('version')}, settings {r['agent'].get('settings_digest')}")
    if r.get("trimmed"):
        out.append(f"    trimmed:  {', '.join(r['trimmed'])} (past the record's bound)")
    return out


def _rule_text(r: dict[str, Any]) -> str:
    kind = r.get("rule")
    if kind == "xid":
        default = "an event by default" if r.get("event_by_default") else "a fault by default"
        return f"Xid {r['code']} in NVIDIA's catalog: bucket {r['bucket']}, {r['catalog']} ({default})"
    if kind == "sxid":
        return f"SXid {r['code']} (an NVSwitch's): {r['severity']}"
    if kind == "ecc":
        return f"more than --ecc-threshold {r['threshold']} {r['measure']}"
    if kind == "signal":
        window = f" within {r['window_s']:g} s" if r.get("window_s") else ""
        return f"signal {r['signal']} ({r['level']}): threshold {r['threshold']:g}{window}; {r['measure']}"
    if kind == "recovery-action":
        return f"NVML's GPU recovery action {r['action']}"
    return str(kind)
