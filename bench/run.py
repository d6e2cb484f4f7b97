"""`make bench`: runs the shipped benchmarks, prints a table and writes docs/performance.md.

Every figure here is measured by this run on this machine; goals are stated next to them and a missed goal
says so.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import nvml_bench

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = next(
        (
            int(x.split()[1]) // 1024 // 1024
            for x in Path("/proc/meminfo").read_text().splitlines()
            if x.startswith("MemTotal")
        ),
        0,
    )
    system = f"{platform.system()} {platform.release()}"
    return f"{os.cpu_count()} x {cpu}, {mem} GiB RAM, {system}, Python {platform.python_version()}"


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer samples (a smoke run, not for the docs)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    subprocess.run([str(ROOT / "tests" / "fakenvml" / "build.sh")], check=True)
    started = time.monotonic()
    rows: list[tuple[str, str, str, str]] = []

    xid = nvml_bench.xid_latency(samples=10 if args.quick else 60)
    rows.append(
        (
            f"Xid -> /healthz unhealthy, --interval 3, 8 GPUs (n={xid['n']})",
            f"p50 {xid['p50_ms']:.1f} ms, p95 {xid['p95_ms']:.1f} ms, p99 {xid['p99_ms']:.1f} ms",
            "p99 < 100 ms",
            verdict(xid["p99_ms"] < 100),
        )
    )
    ecc = nvml_bench.ecc_latency(samples=4 if args.quick else 20)
    rows.append(
        (
            f"ECC -> /healthz unhealthy, --interval 3, 8 GPUs (n={ecc['n']})",
            f"p50 {ecc['p50_ms']:.0f} ms, p99 {ecc['p99_ms']:.0f} ms",
            "p99 <= 3100 ms",
            verdict(ecc["p99_ms"] <= 3100),
        )
    )
    cpu: dict[int, dict[str, float]] = {}
    for n in (1, 8, 64, 256):
        cpu[n] = nvml_bench.cpu_per_check(n, checks=100 if args.quick else 500)
        rows.append(
            (
                f"CPU per check (snapshot + evaluate), {n} GPUs",
                f"{cpu[n]['cpu_us']:.0f} us CPU ({cpu[n]['cpu_us'] / n:.1f} us/GPU), "
                f"{cpu[n]['wall_us']:.0f} us wall",
                "linear or better",
                "",
            )
        )
    per_gpu_8, per_gpu_256 = cpu[8]["cpu_us"] / 8, cpu[256]["cpu_us"] / 256
    rows[-1] = (*rows[-1][:3], verdict(per_gpu_256 <= per_gpu_8 * 1.5))
    rss = nvml_bench.agent_rss(seconds=5 if args.quick else 20)
    rows.append(
        (
            f"Agent RSS after {rss['seconds']:.0f} s at --interval 0.05, 8 GPUs",
            f"{rss['rss_mb']:.1f} MB (CPU {rss['cpu_s']:.2f} s)",
            "< 64 MB",
            verdict(rss["rss_mb"] < 64),
        )
    )

    table = ["| measurement | result | goal | |", "|---|---|---|---|"]
    table += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    text = "\n".join(table)
    print(text)
    elapsed = time.monotonic() - started
    if not args.no_write and not args.quick:
        doc = f"""# gpuguard performance

The latest `make bench` ({datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}, {elapsed:.0f} s), on {machine()}.
Every figure below comes from `bench/run.py` in this run; re-run `make bench` to reproduce.

How each is measured:
- Xid / ECC latency: the real `gpuguard watch --backend nvml --dry-run` process, pynvml, and the fake
  libnvidia-ml.so.1; the fault is written to the fake library's state file and the clock stops when
  `/healthz` (polled every ~1 ms) shows it. Xids arrive through `nvmlEventSetWait_v2` on the backend's event
  thread and wake the loop; ECC is polled at `--interval`, injected at a random phase of the poll.
- CPU per check: `NvmlBackend.snapshot()` + `policy.evaluate()` in one process through pynvml and the fake
  library (so it includes pynvml's ctypes cost, not a real driver's ioctl cost), mean over 500 checks.
- RSS: VmRSS of the agent process after it ran at `--interval 0.05`.

{text}
"""
        (ROOT / "docs" / "performance.md").write_text(doc)
        print(f"\nwrote docs/performance.md ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
