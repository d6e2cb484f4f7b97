"""A GPU that hangs, blinks or moves (issue 24), through the real pynvml and the fake libnvidia-ml.so.1:
each test is named after the defect it pins, and failed on the code before the fix."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.agentproc import WatchProcess, healthz_status
from tests.test_nvml_backend import ROOT, env, state_file


@contextmanager
def agent(lib: Path, state: Path, *extra: str) -> Iterator[WatchProcess]:
    args = ("--backend", "nvml", "--dry-run", "--interval", "0.2", *extra)  # a later --interval wins
    p = WatchProcess(*args, env=env(lib, state)).start()
    try:
        p.wait_first_check(15)
        yield p
    finally:
        assert p.stop() == 0, p.lines[-10:]
        assert not p.tracebacks()


def watch_until(p: WatchProcess, pred: Any, timeout: float) -> tuple[dict[str, Any], float, set[int]]:
    """Poll /healthz until pred holds: the last body, the seconds it took, every status code seen."""
    start, codes = time.monotonic(), set()
    while True:
        code, doc = healthz_status(p.port)
        codes.add(code)
        if pred(doc) or time.monotonic() - start > timeout:
            return doc, time.monotonic() - start, codes
        time.sleep(0.02)


def reasons_of(doc: dict[str, Any], uuid: str) -> list[str]:
    return [r.split(":")[0] for g in doc["gpus"] if g["uuid"] == uuid for r in g["reasons"]]


TWO = "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n"


def test_a_hung_nvml_call(fakenvml: Path, tmp_path: Path) -> None:
    """An ECC read that never returns on GPU 1, and an Xid 79 on it during the hang: within the deadline
    (1 s here) GPU 1 is gpu-unresponsive and xid-79, the node would be tainted, /healthz stays 200 with the
    stuck call on it, GPU 0 stays healthy; the call returning clears gpu-unresponsive, never the Xid."""
    s = state_file(tmp_path, TWO)
    with agent(fakenvml, s, "--nvml-call-timeout", "1") as p:
        s.write_text(TWO + "hang nvmlDeviceGetTotalEccErrors gpu=1\nxid 1 79\n")
        doc, took, codes = watch_until(
            p, lambda d: {"xid-79", "gpu-unresponsive"} <= set(reasons_of(d, "GPU-0b")) and d["tainted"], 6
        )
        assert {"xid-79", "gpu-unresponsive"} <= set(reasons_of(doc, "GPU-0b")), doc
        assert took < 1 + 1.5, took
        assert doc["tainted"] and reasons_of(doc, "GPU-0a") == []
        assert doc["nvml_stuck_calls"] == [
            "nvmlDeviceGetTotalEccErrors has not returned within 1 s (GPU 1, GPU-0b)"
        ]
        time.sleep(1.0)  # the loop goes on, still 200, and leaks no second thread for the same call
        doc, _, more = watch_until(p, lambda d: False, 0.5)
        assert codes | more == {200}
        assert len(doc["nvml_stuck_calls"]) == 1 and len(p.events("nvml.call_hung")) == 1
        s.write_text(TWO + "xid 1 79\n")
        doc, _, _ = watch_until(p, lambda d: "gpu-unresponsive" not in reasons_of(d, "GPU-0b"), 5)
        assert reasons_of(doc, "GPU-0b") == ["xid-79"] and doc["nvml_stuck_calls"] == []
        assert p.events("nvml.call_returned")


def test_a_hung_device_count_makes_the_node_nvml_unresponsive_and_keeps_its_gpus(
    fakenvml: Path, tmp_path: Path
) -> None:
    s = state_file(tmp_path, TWO)
    with agent(fakenvml, s, "--nvml-call-timeout", "1") as p:
        s.write_text(TWO + "hang nvmlDeviceGetCount\n")
        doc, _, codes = watch_until(p, lambda d: d["node_reasons"], 5)
        assert [r.split(":")[0] for r in doc["node_reasons"]] == ["nvml-unresponsive"], doc
        assert [g["uuid"] for g in doc["gpus"]] == ["GPU-0a", "GPU-0b"]
        assert all(g["reasons"] == [] for g in doc["gpus"]), "no GPU is invented missing"
        assert codes == {200} and doc["nvml_stuck_calls"]
        s.write_text(TWO)
        doc, _, _ = watch_until(p, lambda d: d["healthy"], 5)
        assert doc["healthy"] and doc["node_reasons"] == [] and doc["nvml_stuck_calls"] == []


RESTART = """
import json, sys, time
from pathlib import Path
from gpuguard.agent import Agent
from gpuguard.config import NodeSettings, PolicySettings
from gpuguard.node.reconciler import NodeReconciler
from gpuguard.node.view import NodeView
from gpuguard.nvml.real import NvmlBackend
from gpuguard.state import StateStore
from tests.fakes import FakeNodeWriter

state = StateStore(sys.argv[1], boot_id="boot-1")
restored = [f.key for f in state.load()]
writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="boot-1"))
agent = Agent(
    backend=NvmlBackend(deadline=0.5), reconciler=NodeReconciler(writer, NodeSettings(name="gpu-1")),
    policy=PolicySettings(), interval=1.0, node_name="gpu-1", state=state,
)
agent.restore()
agent._backend.open(lambda: None)
t0 = time.monotonic()
verdict = agent.check_once()
print(json.dumps({"restored": restored, "took": time.monotonic() - t0,
                  "faults": [f.key for f in verdict.faults]}), flush=True)
"""


def test_an_agent_restarted_while_the_driver_still_hangs_reports_the_hang_at_once(
    fakenvml: Path, tmp_path: Path
) -> None:
    """The fault is in --state-dir before any retry: the next process (the driver still hangs) restores it
    before its first NVML call, and its own first check ends within the deadline instead of hanging."""
    s = state_file(tmp_path, TWO + "hang nvmlDeviceGetTotalEccErrors gpu=1\n")
    runs = []
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, "-c", RESTART, str(tmp_path / "state")],
            env=env(fakenvml, s),
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
            check=False,
        )
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert runs[0]["restored"] == [] and runs[0]["faults"] == ["gpu-unresponsive/GPU-0b"]
    assert runs[1]["restored"] == ["gpu-unresponsive/GPU-0b"]
    assert runs[1]["faults"] == ["gpu-unresponsive/GPU-0b"] and runs[1]["took"] < 2.0


def test_a_stuck_xid_event_thread_is_unwatched_and_rebuilt_without_waiting_for_the_interval(
    fakenvml: Path, tmp_path: Path
) -> None:
    """The wait hangs in the driver with --interval 30: within two heartbeats (1 s each with a 0.5 s call
    deadline) every GPU says xid_watched false, the stuck wait is on /healthz (still 200) and logged; when
    the driver lets go the path watches again and an Xid is judged at once."""
    s = state_file(tmp_path, TWO)
    with agent(fakenvml, s, "--nvml-call-timeout", "0.5", "--interval", "30") as p:
        s.write_text(TWO + "hang nvmlEventSetWait\n")
        doc, took, codes = watch_until(p, lambda d: not any(g["xid_watched"] for g in d["gpus"]), 6)
        assert not any(g["xid_watched"] for g in doc["gpus"]) and took < 4, (took, doc)
        assert codes == {200} and any("nvmlEventSetWait" in c for c in doc["nvml_stuck_calls"])
        assert p.events("nvml.event_thread_stuck")
        s.write_text(TWO)
        doc, _, _ = watch_until(p, lambda d: all(g["xid_watched"] for g in d["gpus"]), 6)
        assert all(g["xid_watched"] for g in doc["gpus"]), doc
        s.write_text(TWO + "xid 1 79\n")
        doc, took, _ = watch_until(p, lambda d: "xid-79" in reasons_of(d, "GPU-0b"), 3)
        assert reasons_of(doc, "GPU-0b") == ["xid-79"] and took < 1.0, (took, doc)


def test_the_event_path_waits_for_the_poll(fakenvml: Path, tmp_path: Path) -> None:
    """Two failed waits in a row (the second at once, so the rebuild backs off 1 s) with --interval 30: the
    path is rebuilt when the backoff ends, not at the next poll, and an Xid 3 s later is judged."""
    s = state_file(tmp_path, TWO)
    with agent(fakenvml, s, "--interval", "30") as p:
        time.sleep(1.2)  # the first wait is a good one
        s.write_text(TWO + "fail nvmlEventSetWait UNKNOWN count=2\n")
        time.sleep(3.0)
        s.write_text(TWO + "fail nvmlEventSetWait UNKNOWN count=2\nxid 0 79\n")
        doc, _, _ = watch_until(p, lambda d: "xid-79" in reasons_of(d, "GPU-0a"), 3)
        assert reasons_of(doc, "GPU-0a") == ["xid-79"], doc
        assert len(p.events("nvml.event_path_rebuilt")) >= 2
