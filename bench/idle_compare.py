"""An idle agent of this tree and one of an earlier commit, side by side in the same window beside the NVML
polling floor: "unchanged or better" measured under the same load, which two `make bench` runs on a shared
machine cannot tell apart (the floor itself moves by half between runs).

    python -m bench.idle_compare REF [SECONDS]      # e.g. REF=9fdcc0e, SECONDS=600 (the default)

REF's tree is exported (git archive) into a temporary directory and run with this tree's interpreter and
libraries (PYTHONPATH), against the same fake libnvidia-ml.so.1 (build/fakenvml: `make fakenvml`), each
agent with its own 8 fake GPUs, `--backend nvml --dry-run --interval 3`, as the bench's idle agent. Prints
JSON: per agent CPU-s an hour, its ratio to the floor and its wake-ups an hour; the floor's.
Not part of `make bench`: it answers a question about a change, not about the shipped agent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.nvml_bench import ALL_SIGNALS, LIB_DIR, ROOT, IdleFloor, gpu_lines, task_cpu_and_wakeups

GPUS, INTERVAL = 8, 3.0


def _export(ref: str, into: Path) -> Path:
    """REF's tracked files under `into` (no worktree: nothing to clean up in the repository)."""
    archive = into / "ref.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(archive), ref], cwd=ROOT, check=True)
    tree = into / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def _agent(tree: Path, state: Path) -> subprocess.Popen[bytes]:
    state.write_text(gpu_lines(GPUS, signals=ALL_SIGNALS))
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(LIB_DIR),
        "FAKE_NVML_STATE": str(state),
        "PYTHONPATH": str(tree),  # this tree's gpuguard is an editable install: the path comes first
    }
    args = ["watch", "--backend", "nvml", "--dry-run", "--interval", str(INTERVAL), "--listen", "127.0.0.1:0"]
    code = "import sys; from gpuguard.cli import main; sys.argv[0] = 'gpuguard'; main()"
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=tree,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def compare(ref: str, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        trees = {ref: _export(ref, tmp), "this tree": ROOT}
        procs = {name: _agent(tree, tmp / f"{i}.state") for i, (name, tree) in enumerate(trees.items())}
        try:
            time.sleep(2 * INTERVAL + 2)  # past the start-up
            for name, p in procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"the agent of {name} exited with {p.returncode}")
            floor = IdleFloor(procs["this tree"].pid, gpus=GPUS, interval=INTERVAL)
            start = {name: task_cpu_and_wakeups(p.pid) for name, p in procs.items()}
            t0 = time.monotonic()
            time.sleep(seconds)
            end = {name: task_cpu_and_wakeups(p.pid) for name, p in procs.items()}
            window = time.monotonic() - t0
            fl = floor.finish()
        finally:
            for p in procs.values():
                p.terminate()
                p.wait()
    per_hour = 3600 / window
    out: dict[str, Any] = {
        "window_s": round(window),
        "floor": {
            "cpu_s_per_hour": round(fl["floor_cpu_s_per_hour"], 3),
            "wakeups_per_hour": round(fl["floor_wakeups_per_hour"]),
        },
        "load_1min_at_end": os.getloadavg()[0],
    }
    for name in procs:
        cpu = (end[name][0] - start[name][0]) * per_hour
        out[name] = {
            "cpu_s_per_hour": round(cpu, 3),
            "ratio_to_floor": round(cpu / fl["floor_cpu_s_per_hour"], 2),
            "wakeups_per_hour": round((end[name][1] - start[name][1]) * per_hour),
        }
    return out


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python -m bench.idle_compare REF [SECONDS]")
    print(json.dumps(compare(sys.argv[1], float(sys.argv[2]) if len(sys.argv) == 3 else 600.0), indent=1))
