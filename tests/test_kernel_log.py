"""The kernel log (/dev/kmsg) as a second source of Xids, through its stand-in (tests/kmsglog.py): with the
mock backend in-process, and with the fake libnvidia-ml.so.1 under `gpuguard watch` where NVML hangs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpuguard.core.config import NodeSettings, PolicySettings
from gpuguard.core.metrics import Metrics
from gpuguard.core.model import Snapshot
from gpuguard.nvml.kmsg.merge import KernelLogBackend, kernel_log_backend
from gpuguard.nvml.kmsg.records import Malformed, parse_record, parse_xid
from gpuguard.nvml.mock import MockBackend, parse_scenario
from gpuguard.quarantine.node.view import NodeView
from gpuguard.quarantine.reconciler import NodeReconciler
from gpuguard.runtime.agent import Agent
from gpuguard.store.state import StateStore
from harness.clock import Clock
from harness.fakes import FakeNodeWriter
from tests.kmsglog import KernelLog

GPU1_PCI = "0000:02:00"  # the mock's GPU 1: 00000000:02:00.0


def wired(log: Path, scenario: str = "gpus: 2", *, state: StateStore | None = None):  # type: ignore[no-untyped-def]
    clock = Clock(1000.0)
    mock = MockBackend(parse_scenario(scenario), clock=clock, start_timer=False)
    metrics = Metrics(CollectorRegistry())
    judged = state.kernel_seq if state is not None else lambda: None
    backend = kernel_log_backend(mock, str(log), metrics=metrics, judged=judged)
    writer = FakeNodeWriter(NodeView(name="gpu-1", resource_version="1", boot_id="b"))
    reconciler = NodeReconciler(writer, NodeSettings(name="gpu-1"))
    agent = Agent(
        backend=backend,
        reconciler=reconciler,
        policy=PolicySettings(),
        interval=1.0,
        node_name="gpu-1",
        metrics=metrics,
        state=state,
        clock=clock,
    )
    agent.restore()
    backend.open(agent.wakeup)
    assert backend._reader.replayed.wait(5)
    return agent, backend, writer, reconciler, metrics, clock


def settle(backend: KernelLogBackend, count: int, timeout: float = 5.0) -> None:
    """Until the reader has handed `count` records to the backend."""
    end = time.monotonic() + timeout
    while len(backend._pending) < count and time.monotonic() < end:
        time.sleep(0.01)


def kernel_xids(snapshot: Snapshot) -> list[int]:
    return [x.code for x in snapshot.xids if x.source == "kmsg"]


def test_an_xid_written_to_the_log_while_the_agent_was_stopped_is_quarantined_at_start(
    tmp_path: Path,
) -> None:
    log = KernelLog(tmp_path / "kmsg")
    log.xid(GPU1_PCI, 79, at=5.0)  # logged long before the agent started
    agent, backend, writer, reconciler, _, _ = wired(log.path, state=StateStore(tmp_path, boot_id="boot-1"))
    try:
        verdict = agent.check_once()
        reconciler.reconcile_now()
    finally:
        backend.close()
    assert [(f.key, f.gpu_index) for f in verdict.faults] == [("xid-79/GPU-mock-1", 1)]
    assert "kernel log: pid 1234, process python, GPU has fallen off the bus." in verdict.faults[0].detail
    assert writer.node.our_taint is not None and writer.node.record.primary_reason == "xid-79"


def test_a_log_xid_judged_before_a_restart_is_not_judged_again(tmp_path: Path) -> None:
    log = KernelLog(tmp_path / "kmsg")
    seq = log.xid(GPU1_PCI, 79, at=5.0)
    agent, backend, *_ = wired(log.path, state=StateStore(tmp_path, boot_id="boot-1"))
    agent.check_once()
    backend.close()
    assert StateStore(tmp_path, boot_id="boot-1").kernel_seq() == seq
    again, backend2, *_ = wired(log.path, state=StateStore(tmp_path, boot_id="boot-1"))
    try:
        assert kernel_xids(backend2.snapshot()) == []  # the replay skipped it
        assert [f.key for f in again.check_once().faults] == ["xid-79/GPU-mock-1"]  # restored, once
    finally:
        backend2.close()
    # Another boot: its log is new, and so is everything in it.
    _, backend3, *_ = wired(log.path, state=StateStore(tmp_path, boot_id="boot-2"))
    try:
        assert kernel_xids(backend3.snapshot()) == [79]
    finally:
        backend3.close()


@pytest.mark.parametrize("kernel_first", [True, False])
def test_an_xid_both_sources_report_is_one_fault(tmp_path: Path, kernel_first: bool) -> None:
    log = KernelLog(tmp_path / "kmsg")
    _, backend, _, _, _, clock = wired(log.path, "gpus: 2\nevents:\n  - {at: 1.0, gpu: 1, xid: 79}\n")
    try:
        if kernel_first:
            log.xid(GPU1_PCI, 79)
            settle(backend, 1)
            first = backend.snapshot()
            clock.t += 1.0
            second = backend.snapshot()
        else:
            clock.t += 1.0
            first = backend.snapshot()
            log.xid(GPU1_PCI, 79)
            settle(backend, 1)
            second = backend.snapshot()
        reports = [(x.source, x.code) for x in (*first.xids, *second.xids)]
        assert reports == [("kmsg" if kernel_first else "nvml", 79)]
        assert backend.duplicates == 1
        assert log.seq in (first.kernel_seq, second.kernel_seq)  # read, kept as read even as a duplicate
    finally:
        backend.close()


def test_the_same_code_on_the_same_gpu_far_apart_in_time_is_two_xids(tmp_path: Path) -> None:
    log = KernelLog(tmp_path / "kmsg")
    # Ten minutes before (or at boot, on a host up for less): replayed, matched by its timestamp.
    log.xid(GPU1_PCI, 79, at=max(time.monotonic() - 600, 0.0))
    _, backend, _, _, _, clock = wired(log.path, "gpus: 2\nevents:\n  - {at: 1.0, gpu: 1, xid: 79}\n")
    try:
        clock.t += 1.0
        assert [(x.source, x.code) for x in backend.snapshot().xids] == [("nvml", 79), ("kmsg", 79)]
        assert backend.duplicates == 0
    finally:
        backend.close()


def test_an_sxid_record_is_judged(tmp_path: Path) -> None:
    log = KernelLog(tmp_path / "kmsg")
    log.sxid("0000:c1:00", 20034, "Fatal")
    log.sxid("0000:c1:00", 12028, "Non-fatal", "Link 37 egress non-posted PRIV error")
    agent, backend, *_ = wired(log.path)
    try:
        verdict = agent.check_once()
    finally:
        backend.close()
    assert [f.key for f in verdict.node_faults] == ["sxid-20034/node"]
    assert verdict.node_faults[0].detail == (
        "NVSwitch SXid 20034 (NVSwitch at PCI 0000:c1:00, kernel log: Fatal, Link 30 LTSSM Fault Up)"
    )
    assert [x.code for x in verdict.ignored_xids] == [12028]  # a Non-fatal one is an event


def test_an_xid_of_a_pci_address_no_gpu_has_is_a_fault_of_the_node_naming_it(tmp_path: Path) -> None:
    log = KernelLog(tmp_path / "kmsg")
    log.xid("0000:9a:00", 48)
    agent, backend, *_ = wired(log.path)
    try:
        verdict = agent.check_once()
    finally:
        backend.close()
    assert [f.key for f in verdict.node_faults] == ["xid-48/node"]
    assert "GPU at PCI 0000:9a:00 not identified by NVML" in verdict.node_faults[0].detail


def test_malformed_and_oversized_records_are_counted_and_skipped_never_a_crash(tmp_path: Path) -> None:
    log = KernelLog(tmp_path / "kmsg")
    log.raw(b"this is no kmsg record\n")
    log.raw(b"6,x,1,-;NVRM: Xid (PCI:0000:02:00): 79, bad sequence\n")
    log.raw(b"3,7,1,-;NVRM: Xid (PCI:0000:02:00): 79, " + b"A" * 20000 + b"\n")
    log.raw(b"\xff\xfe\x00garbage\n")
    log.xid(GPU1_PCI, 79)  # the good record after them is still judged
    agent, backend, _, _, metrics, _ = wired(log.path)
    try:
        settle(backend, 1)
        verdict = agent.check_once()
    finally:
        backend.close()
    assert [f.key for f in verdict.faults] == ["xid-79/GPU-mock-1"]
    skipped = {
        s.labels["why"]: s.value
        for m in metrics.registry.collect()
        if m.name == "gpuguard_kernel_log_records_skipped"
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert skipped == {"malformed": 3.0, "oversized": 1.0}


@pytest.mark.parametrize(
    ("line", "want"),
    [
        (
            b"3,12,5000000,-;NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics",
            (13, False, "0000:cb:00", None, None),
        ),
        (
            b"4,13,1,-,caller=T9;NVRM: Xid (PCI:0000:3B:00): 109, pid=1797828, name=pt_main_thread, Ch 08",
            (109, False, "0000:3b:00", 1797828, "pt_main_thread"),
        ),
        (
            b"4,14,1,-;NVRM: Xid (0000:3b:00): 79, GPU has fallen off the bus.",
            (79, False, "0000:3b:00", None, None),
        ),
        (
            b"4,15,1,-;nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 37",
            (12028, True, "0000:05:00", None, None),
        ),
        (b"6,16,1,-;usb 1-1: new high-speed USB device", None),
    ],
)
def test_the_driver_lines_are_parsed_as_the_driver_writes_them(line: bytes, want: object) -> None:
    xid = parse_xid(parse_record(line))
    got = None if xid is None else (xid.code, xid.sxid, xid.line.pci, xid.line.pid, xid.line.process)
    assert got == want


def test_a_record_without_a_header_is_malformed() -> None:
    with pytest.raises(Malformed):
        parse_record(b"NVRM: Xid (PCI:0000:3b:00): 79, no header")


def test_with_nvml_hung_a_log_xid_is_still_written(fakenvml: Path, tmp_path: Path) -> None:
    """Every NVML pass hangs in nvmlDeviceGetCount (the event set is the driver's too): an Xid 79 the kernel
    logs for GPU 1 is judged from the last inventory's PCI bus IDs and written (a dry run's node patch)."""
    from tests.test_nvml_backend import state_file
    from tests.test_nvml_faults import TWO, agent, reasons_of, watch_until

    s = state_file(tmp_path, TWO)
    log = KernelLog(tmp_path / "kmsg")
    with agent(fakenvml, s, "--nvml-call-timeout", "1", "--kernel-log", str(log.path)) as p:
        s.write_text(TWO + "hang nvmlDeviceGetCount\nhang nvmlEventSetWait\n")
        # The limits only bound a wait on a loaded machine: the agent answers well within a second or two.
        watch_until(p, lambda d: d["nvml_stuck_calls"], 15)
        log.xid("0000:3c:00", 79)  # the fake's GPU 1: 00000000:3C:00.0
        doc, _, codes = watch_until(p, lambda d: "xid-79" in reasons_of(d, "GPU-0b") and d["tainted"], 15)
        assert "xid-79" in reasons_of(doc, "GPU-0b") and doc["tainted"], doc
        assert codes == {200} and doc["nvml_stuck_calls"]
        # /healthz may say so a moment before the patch's log line is read from the agent's output.
        deadline = time.monotonic() + 10
        while not [e for e in p.events("node.dry_run") if "xid-79" in str(e.get("patch"))]:
            assert time.monotonic() < deadline, p.lines[-20:]
            time.sleep(0.05)
