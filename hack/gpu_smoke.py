"""gpuguard on a machine with a real NVIDIA GPU and driver: `make gpu-smoke` (docs/reliability.md).

1. `gpuguard check --backend nvml -o json` through the real libnvidia-ml.so.1;
2. the nvml backend's readings, five passes, timed (NVML time per check), compared with `nvidia-smi -q -x`:
   UUIDs, volatile uncorrected ECC counts, remapped rows (pending, failure), the GPU recovery action;
3. `gpuguard watch --dry-run --backend nvml` for 20 s, its /healthz read while it runs: per GPU whether
   Xid events are watched; the watch must exit 0 with no traceback and no failed check.

Exit 0 when everything matches, 1 on any mismatch or failure (each printed), 2 when there is no GPU to test.
It has NOT been run on a GPU yet (no GPU in the project's sessions): tests/test_gpu_smoke.py runs it
against the fake library and a fake nvidia-smi, which checks the script, not NVIDIA's XML. The XML tags read
here are those of R535+ drivers (ecc_errors/volatile/*uncorrectable*, remapped_rows/*), older ones
(volatile/double_bit/total) as a fallback, and any element whose tag contains "recovery_action".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuguard.core.model import RECOVERY_ACTIONS  # noqa: E402

WATCH_SECONDS = float(os.environ.get("GPU_SMOKE_WATCH_SECONDS", "20"))
problems: list[str] = []


def problem(text: str) -> None:
    problems.append(text)
    print(f"MISMATCH: {text}")


def gpuguard(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuguard", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None


def smi_gpus(xml: str) -> dict[str, dict[str, Any]]:
    """nvidia-smi -q -x -> {uuid: {ecc, remap_pending, remap_failure, recovery}}; None: N/A or absent."""
    out: dict[str, dict[str, Any]] = {}
    for gpu in ET.fromstring(xml).iter("gpu"):
        uuid = (gpu.findtext("uuid") or "").strip()
        ecc: int | None = None
        vol = gpu.find("ecc_errors/volatile")
        if vol is not None:
            parts = [_int(e.text) for e in vol if "uncorrectable" in e.tag]
            if not parts:  # older drivers: double_bit/total
                parts = [_int(vol.findtext("double_bit/total"))]
            if parts and all(p is not None for p in parts):
                ecc = sum(p for p in parts if p is not None)
        rr = gpu.find("remapped_rows")

        def yes(tag: str, rr: Any = rr) -> bool | None:
            text = (rr.findtext(tag) or "").strip().lower() if rr is not None else ""
            return {"yes": True, "no": False}.get(text)

        recovery: int | None = None
        for e in gpu.iter():
            if "recovery_action" in e.tag and e.text and e.text.strip():
                key = re.sub(r"[^a-z]", "", e.text.lower())
                names = {re.sub(r"[^a-z]", "", v): k for k, v in RECOVERY_ACTIONS.items()}
                recovery = names.get(key, names.get(key.removesuffix("required")))
        out[uuid] = {
            "ecc": ecc,
            "remap_pending": yes("remapped_row_pending"),
            "remap_failure": yes("remapped_row_failure"),
            "recovery": recovery,
        }
    return out


def main() -> int:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        print("gpu-smoke: nvidia-smi not found: this needs a machine with an NVIDIA GPU and driver")
        return 2

    print("== gpuguard check --backend nvml")
    r = gpuguard("check", "--backend", "nvml", "-o", "json", timeout=120)
    print(r.stdout.strip() or "(no output)")
    if r.stderr.strip():
        print(r.stderr.strip())
    if r.returncode not in (0, 1) or "Traceback" in r.stderr:
        problem(f"check exited {r.returncode}")
    check_doc = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {"gpus": []}
    check_uuids = sorted(g["uuid"] for g in check_doc["gpus"])

    print("== nvidia-smi -q -x")
    xml = subprocess.run([smi, "-q", "-x"], capture_output=True, text=True, check=True, timeout=120).stdout
    smi_by_uuid = smi_gpus(xml)
    if not smi_by_uuid:
        print("gpu-smoke: nvidia-smi reports no GPU")
        return 2

    print("== the nvml backend, 5 passes")
    from gpuguard.nvml.real import NvmlBackend

    backend = NvmlBackend()
    backend.open(lambda: None)
    times: list[float] = []
    try:
        for _ in range(5):
            t0 = time.perf_counter()
            snap = backend.snapshot()
            times.append(time.perf_counter() - t0)
            time.sleep(0.2)
    finally:
        backend.close()
    if snap.init_error:
        problem(f"NVML init failed: {snap.init_error}")
    ours = {g.uuid: g for g in snap.gpus}
    if sorted(ours) != sorted(smi_by_uuid):
        problem(f"UUIDs: gpuguard {sorted(ours)} != nvidia-smi {sorted(smi_by_uuid)}")
    if check_uuids != sorted(smi_by_uuid):
        problem(f"UUIDs: gpuguard check {check_uuids} != nvidia-smi {sorted(smi_by_uuid)}")
    for uuid, s in smi_by_uuid.items():
        g = ours.get(uuid)
        if g is None:
            continue
        pairs = [
            ("volatile uncorrected ECC", g.ecc_uncorrected, s["ecc"]),
            ("remapped rows pending", g.remap_pending, s["remap_pending"]),
            ("remapped rows failure", g.remap_failure, s["remap_failure"]),
            ("recovery action", g.recovery_action, s["recovery"]),
        ]
        for what, mine, theirs in pairs:
            if mine is not None and theirs is not None and mine != theirs:
                problem(f"{uuid} {what}: gpuguard {mine} != nvidia-smi {theirs}")
            elif mine is None and theirs is not None and what != "recovery action":
                problem(f"{uuid} {what}: gpuguard reads nothing, nvidia-smi says {theirs}")

    print(f"== gpuguard watch --dry-run for {WATCH_SECONDS:.0f} s")
    p = subprocess.Popen(
        [sys.executable, "-m", "gpuguard", "watch", "--backend", "nvml", "--dry-run", "--interval", "1",
         "--run-for", str(WATCH_SECONDS), "--listen", "127.0.0.1:0", "--log-format", "json"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT,
    )  # fmt: skip
    assert p.stderr is not None
    lines: list[str] = []
    port = None
    for line in p.stderr:
        lines.append(line)
        if '"server.listening"' in line:
            port = json.loads(line)["port"]
            break
    health: dict[str, Any] = {}
    if port is not None:
        time.sleep(min(5.0, WATCH_SECONDS / 2))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            health = json.loads(resp.read())
    _, rest = p.communicate(timeout=WATCH_SECONDS + 30)
    lines.extend(rest.splitlines())
    log = "".join(lines)
    if p.returncode != 0 or "Traceback" in log or '"check.failed"' in log:
        problem(f"watch exited {p.returncode}; log:\n{log[-3000:]}")

    print()
    print(f"{'GPU':<4} {'UUID':<42} {'XIDS WATCHED':<13} {'ECC':<9} {'REMAP P/F':<10} {'RECOVERY':<9}")
    watched = {g["uuid"]: g["xid_watched"] for g in health.get("gpus", [])}
    for uuid, g in sorted(ours.items(), key=lambda kv: kv[1].index):
        s = smi_by_uuid.get(uuid, {})
        print(
            f"{g.index:<4} {uuid:<42} {watched.get(uuid, 'unknown')!s:<13} "
            f"{g.ecc_uncorrected!s}/{s.get('ecc')!s:<6} {g.remap_pending!s}/{g.remap_failure!s:<4} "
            f"{g.recovery_action!s}/{s.get('recovery')!s}"
        )
        if watched.get(uuid) is not True:
            print(f"     Xids NOT watched on GPU {g.index}: {g.xid_watch_note or 'see the watch log'}")
    ms = [t * 1000 for t in times]
    print(
        f"NVML time per check: median {statistics.median(ms):.2f} ms, max {max(ms):.2f} ms ({len(ours)} GPUs)"
    )
    if problems:
        print(f"gpu-smoke: {len(problems)} mismatch(es)")
        return 1
    print("gpu-smoke: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
