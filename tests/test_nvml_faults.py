"""A GPU that hangs, blinks or moves (issue 24), through the real pynvml and the fake libnvidia-ml.so.1:
each test is named after the defect it pins, and failed on the code before the fix."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from harness.agentproc import WatchProcess, healthz_status
from tests.test_nvml_backend import ROOT, check, env, state_file


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
from gpuguard.runtime.agent import Agent
from gpuguard.core.config import NodeSettings, PolicySettings
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.quarantine.node.view import NodeView
from gpuguard.nvml.real import NvmlBackend
from gpuguard.store.state import StateStore
from harness.fakes import FakeNodeWriter

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
    """The wait hangs in the driver with --interval 30: within two heartbeats (3 s each with a 0.5 s call
    deadline) every GPU says xid_watched false, the stuck wait is on /healthz (still 200) and logged; when
    the driver lets go the path watches again and an Xid is judged at once."""
    s = state_file(tmp_path, TWO)
    with agent(fakenvml, s, "--nvml-call-timeout", "0.5", "--interval", "30") as p:
        s.write_text(TWO + "hang nvmlEventSetWait\n")
        doc, took, codes = watch_until(p, lambda d: not any(g["xid_watched"] for g in d["gpus"]), 12)
        assert not any(g["xid_watched"] for g in doc["gpus"]) and took < 9, (took, doc)
        assert codes == {200} and any("nvmlEventSetWait" in c for c in doc["nvml_stuck_calls"])
        assert p.events("nvml.event_thread_stuck")
        s.write_text(TWO)
        doc, _, _ = watch_until(p, lambda d: all(g["xid_watched"] for g in d["gpus"]), 10)
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


def test_one_blink_is_a_quarantine(fakenvml: Path, tmp_path: Path) -> None:
    """One failed nvmlDeviceGetCount (UNKNOWN) mid-run is retried, not judged: the node stays healthy and
    untainted; a count that keeps failing is nvml-init after three checks."""
    s = state_file(tmp_path, TWO)
    with agent(fakenvml, s) as p:
        s.write_text(TWO + "fail nvmlDeviceGetCount UNKNOWN count=1\n")
        doc, _, _ = watch_until(p, lambda d: not d["healthy"] or d["tainted"], 1.5)
        assert doc["healthy"] and not doc["tainted"], doc
        assert p.events("nvml.device_count_failed")
        s.write_text(TWO + "fail nvmlDeviceGetCount TIMEOUT\n")
        doc, _, _ = watch_until(p, lambda d: not d["healthy"], 4)
        assert [r.split(":")[0] for r in doc["node_reasons"]] == ["nvml-init"], doc
        # Three checks at --interval 0.2 (or one more where a check came late): 0.4 s or more.
        assert re.search(
            r"failed for \d+\.\d s, [34] checks at --interval 0.2 \(TIMEOUT\)", doc["node_reasons"][0]
        )
        assert [g["uuid"] for g in doc["gpus"]] == ["GPU-0a", "GPU-0b"]
        assert all(g["reasons"] == [] for g in doc["gpus"]), "no GPU is invented missing"


NOT_SUPPORTED_ECC = (
    "gpu 0 uuid=GPU-0a remap_supported=0 recovery_supported=0\n"
    "fail nvmlDeviceGetTotalEccErrors NOT_SUPPORTED\n"
)


def test_not_supported_read_as_broken(fakenvml: Path, tmp_path: Path) -> None:
    """ECC mode answers, the ECC counter says NOT_SUPPORTED (and nothing else is polled): not applicable,
    never gpu-unreadable, in watch and in check."""
    s = state_file(tmp_path, NOT_SUPPORTED_ECC)
    with agent(fakenvml, s) as p:
        doc, _, _ = watch_until(p, lambda d: not d["healthy"], 1.5)
        assert doc["healthy"], doc
    code, doc, _ = check(fakenvml, s)
    assert code == 0 and doc["gpus"][0]["healthy"], doc


def test_nvidias_recovery_request_missed(fakenvml: Path, tmp_path: Path) -> None:
    """The recovery field answered NOT_SUPPORTED once; the driver then supports it and announces a GPU reset
    with Xid 154: the field is read again and the reset is the fault. Where the field stays NOT_SUPPORTED,
    the Xid 154 itself is the fault."""
    s = state_file(
        tmp_path, "gpu 0 uuid=GPU-0a recovery_supported=0\ngpu 1 uuid=GPU-0b recovery_supported=0\n"
    )
    with agent(fakenvml, s) as p:
        time.sleep(0.5)
        s.write_text(
            "gpu 0 uuid=GPU-0a recovery_supported=1 recovery_action=1\n"
            "gpu 1 uuid=GPU-0b recovery_supported=0\nxid 0 154\nxid 1 154\n"
        )
        doc, _, _ = watch_until(p, lambda d: reasons_of(d, "GPU-0a") and reasons_of(d, "GPU-0b"), 3)
        assert reasons_of(doc, "GPU-0a") == ["recovery-gpu-reset"], doc
        assert reasons_of(doc, "GPU-0b") == ["xid-154"], doc


def test_readings_follow_indices_not_uuids(fakenvml: Path, tmp_path: Path) -> None:
    """A same-count reorder: GPU-0b (with ECC errors) now at index 0. Its ECC fault is GPU-0b's, never
    GPU-0a's; then GPU-0a, now at index 1, is lost: the loss is GPU-0a's, not the UUID index 1 had first."""
    s = state_file(tmp_path, TWO)
    with agent(fakenvml, s) as p:
        s.write_text("gpu 0 uuid=GPU-0b ecc=3\ngpu 1 uuid=GPU-0a\n")
        doc, _, _ = watch_until(p, lambda d: not d["healthy"], 3)
        time.sleep(0.5)
        doc, _, _ = watch_until(p, lambda d: False, 0.1)
        assert reasons_of(doc, "GPU-0b") == ["ecc"] and reasons_of(doc, "GPU-0a") == [], doc
        assert {g["uuid"]: g["index"] for g in doc["gpus"]} == {"GPU-0a": 1, "GPU-0b": 0}
        assert p.events("nvml.gpu_moved")
        s.write_text("gpu 0 uuid=GPU-0b ecc=3\ngpu 1 uuid=GPU-0a lost=1\n")
        doc, _, _ = watch_until(p, lambda d: "gpu-lost" in reasons_of(d, "GPU-0a"), 3)
        assert reasons_of(doc, "GPU-0a") == ["gpu-lost"] and reasons_of(doc, "GPU-0b") == ["ecc"], doc


def test_a_gpu_lost_at_start(fakenvml: Path, tmp_path: Path) -> None:
    """A GPU lost at start that answers later: the node stays unhealthy for it (gpu-lost needs a reboot),
    so /healthz, the condition and the taint agree."""
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b lost=1\n")
    with agent(fakenvml, s) as p:
        doc, _, _ = watch_until(p, lambda d: d["tainted"], 3)
        assert doc["tainted"] and not doc["healthy"], doc
        s.write_text(TWO)
        doc, _, _ = watch_until(p, lambda d: len(d["gpus"]) == 2, 3)
        time.sleep(0.6)
        doc, _, _ = watch_until(p, lambda d: False, 0.1)
        assert len(doc["gpus"]) == 2 and not doc["healthy"] and doc["tainted"], doc
        assert [r.split(":")[0] for r in doc["node_reasons"]] == ["gpu-lost"], doc


def test_zero_gpus(fakenvml: Path, tmp_path: Path) -> None:
    """watch and check give a GPU node with no GPU the same verdict (gpu-missing unless --allow-no-gpu);
    --allow-no-gpu covers no driver, not a broken one (an RM version mismatch)."""
    s = state_file(tmp_path, "# a GPU node whose GPUs NVML does not show\n")
    with agent(fakenvml, s) as p:
        doc, _, _ = watch_until(p, lambda d: not d["healthy"], 2)
        assert not doc["healthy"] and doc["tainted"], doc
    assert check(fakenvml, s)[0] == 1
    with agent(fakenvml, s, "--allow-no-gpu") as p:
        doc, _, _ = watch_until(p, lambda d: not d["healthy"], 1)
        assert doc["healthy"], doc
    broken = state_file(tmp_path, "init_error LIB_RM_VERSION_MISMATCH\ngpu 0\n")
    assert check(fakenvml, broken, "--allow-no-gpu")[0] == 1
    assert check(fakenvml, state_file(tmp_path, "init_error DRIVER_NOT_LOADED\n"), "--allow-no-gpu")[0] == 0


def test_one_log_line_per_ignored_xid(fakenvml: Path, tmp_path: Path) -> None:
    """A storm of 200 ignored Xids (13): one log line for the code in its window, every one in the metric."""
    s = state_file(tmp_path, TWO)
    with agent(fakenvml, s) as p:
        s.write_text(TWO + "xid 0 13\n" * 200)
        deadline = time.monotonic() + 5
        count = 0.0
        while time.monotonic() < deadline and count < 200:
            with urllib.request.urlopen(f"http://127.0.0.1:{p.port}/metrics", timeout=2) as r:
                text = r.read().decode()
            count = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("gpuguard_xid_events_total{") and 'xid="13"' in line
            )
            time.sleep(0.05)
        assert count == 200
        assert healthz_status(p.port)[1]["healthy"]
        assert len(p.events("xid.ignored")) == 1


def test_retired_pages_are_read_by_nothing(fakenvml: Path, tmp_path: Path) -> None:
    """Pre-Ampere page retirement: NVIDIA's limit of 63 retired is the fault retired-pages; pages pending
    retirement are `degraded` (retired-pending, issue 29), not a fault; fewer retired pages are shown (the
    metric), not judged."""
    s = state_file(
        tmp_path,
        "gpu 0 uuid=GPU-0a retired_supported=1 retired_pending=1\n"
        "gpu 1 uuid=GPU-0b retired_supported=1 retired_sbe=40 retired_dbe=23\n"
        "gpu 2 uuid=GPU-0c retired_supported=1 retired_sbe=40 retired_dbe=22\n",
    )
    code, doc, _ = check(fakenvml, s)
    assert code == 1
    assert [(g["uuid"], [r.split(":")[0] for r in g["reasons"]]) for g in doc["gpus"]] == [
        ("GPU-0a", []),
        ("GPU-0b", ["retired-pages"]),
        ("GPU-0c", []),
    ], doc


def test_row_remap_pending_is_shown(fakenvml: Path, tmp_path: Path) -> None:
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a remap_pending=1\ngpu 1 uuid=GPU-0b\n")
    with agent(fakenvml, s) as p:
        doc = healthz_status(p.port)[1]
        assert doc["healthy"] and [g["row_remap_pending"] for g in doc["gpus"]] == [True, False], doc
        with urllib.request.urlopen(f"http://127.0.0.1:{p.port}/metrics", timeout=2) as r:
            text = r.read().decode()
        assert 'gpuguard_gpu_row_remap_pending{gpu="0",uuid="GPU-0a"} 1.0' in text


def test_a_uuid_read_that_hangs_at_start_is_unresponsive_never_missing(
    fakenvml: Path, tmp_path: Path
) -> None:
    """GPU 1's UUID read hangs before it was ever identified: a node fault gpu-unresponsive naming index 1,
    GPU 0 read as usual, no gpu-missing; when the read returns, GPU 1 is enumerated and the fault clears."""
    s = state_file(tmp_path, TWO + "hang nvmlDeviceGetUUID gpu=1\n")
    p = WatchProcess(
        "--backend",
        "nvml",
        "--dry-run",
        "--interval",
        "0.2",
        "--nvml-call-timeout",
        "1",
        env=env(fakenvml, s),
    ).start()
    try:
        p.wait_listening()
        doc, _, codes = watch_until(p, lambda d: d["node_reasons"] and d["gpus"], 8)
        assert [r.split(":")[0] for r in doc["node_reasons"]] == ["gpu-unresponsive"], doc
        assert [g["uuid"] for g in doc["gpus"]] == ["GPU-0a"] and codes == {200}
        assert not any(e.get("reason") == "gpu-missing" for e in p.lines), "never a transient gpu-missing"
        s.write_text(TWO)
        doc, _, _ = watch_until(p, lambda d: d["healthy"], 5)
        assert doc["healthy"] and [g["uuid"] for g in doc["gpus"]] == ["GPU-0a", "GPU-0b"], doc
    finally:
        assert p.stop() == 0
        assert not p.tracebacks()


FALLS_OFF = """
import json, sys, time
from pathlib import Path
from gpuguard.nvml.real import NvmlBackend
s = Path(sys.argv[1])
three = "gpu 0 uuid=GPU-0\\ngpu 1 uuid=GPU-2 ecc=5\\ngpu 2 uuid=GPU-3\\n"
b = NvmlBackend(deadline=0.5)
b.open(lambda: None)
b.snapshot()
s.write_text(three + sys.argv[2] + "\\n")  # GPU 1 is gone: GPU-2 is index 1 now
seen = []
for i in range(6):
    seen.append([(g.index, g.uuid, g.ecc_uncorrected) for g in b.snapshot().gpus])
    if i == 1:
        s.write_text(three)  # the call returns
    time.sleep(0.3)
b.close()
print(json.dumps(seen))
"""


@pytest.mark.parametrize(
    "rule", ["", "hang nvmlDeviceGetUUID gpu=1", "fail nvmlDeviceGetUUID UNKNOWN gpu=1 count=1"]
)
def test_readings_follow_the_uuid_when_a_gpu_falls_off_mid_run(
    fakenvml: Path, tmp_path: Path, rule: str
) -> None:
    """4 GPUs, GPU 1 falls off and the driver counts 3: GPU-2's reading (ECC 5) is GPU-2's in every pass,
    also while the UUID at its new index hangs or fails once; never absent (gpu-missing is sticky)."""
    s = state_file(tmp_path, "".join(f"gpu {i} uuid=GPU-{i}\n" for i in range(4)))
    r = subprocess.run(
        [sys.executable, "-c", FALLS_OFF, str(s), rule],
        check=False,
        capture_output=True,
        text=True,
        env=env(fakenvml, s),
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    passes = json.loads(r.stdout.strip().splitlines()[-1])
    for gpus in passes:
        assert all(uuid == "GPU-2" for _, uuid, ecc in gpus if ecc == 5), passes
        assert "GPU-2" in [uuid for _, uuid, _ in gpus], passes
    assert passes[-1] == [[0, "GPU-0", 0], [1, "GPU-2", 5], [2, "GPU-3", 0]], passes


def test_an_xid_queued_behind_a_hung_event_call_is_judged_when_the_call_returns(
    fakenvml: Path, tmp_path: Path
) -> None:
    """The event thread hangs reading GPU 0's UUID for its Xid; an Xid 79 on GPU 1 arrives meanwhile, in that
    thread's event set only (NVML delivers an event to the sets registered before it). The thread is given up
    and the path rebuilt on a new set; when the call returns, the old set is drained before it is freed, so
    GPU 1's Xid 79 is judged within a second."""
    s = state_file(tmp_path, TWO)
    with agent(fakenvml, s, "--nvml-call-timeout", "0.5", "--interval", "30") as p:
        s.write_text(TWO + "hang nvmlDeviceGetUUID gpu=0\nxid 0 31\n")
        time.sleep(0.3)  # the event thread is in GPU 0's UUID read now
        s.write_text(TWO + "hang nvmlDeviceGetUUID gpu=0\nxid 0 31\nxid 1 79\n")
        deadline = time.monotonic() + 15
        while not p.events("nvml.event_path_rebuilt") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.events("nvml.event_path_rebuilt"), p.lines[-20:]
        time.sleep(0.5)  # the new set is registered
        s.write_text(TWO + "xid 0 31\nxid 1 79\n")  # the call returns
        doc, took, _ = watch_until(p, lambda d: "xid-79" in reasons_of(d, "GPU-0b"), 3)
        assert "xid-79" in reasons_of(doc, "GPU-0b") and took < 1.0, (took, doc)
