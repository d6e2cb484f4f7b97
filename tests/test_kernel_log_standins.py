"""The kernel log's stand-ins for the demo and the tests: the mock scenario's `kernel_log` (its driver logs
its Xids in a file at --kernel-log), the fake NVML library's FAKE_NVML_KMSG (each new `xid` line logged as
the driver would), and `gpuguard check --kernel-log` judging the Xids since boot like NVML's."""

from __future__ import annotations

import json
from pathlib import Path

from gpuguard.nvml.kmsg.records import parse_record, parse_xid
from tests.kmsglog import KernelLog
from tests.test_cli import run
from tests.test_nvml_backend import check, state_file

SCENARIO = """kernel_log: true
gpus: 4
events:
  - {at: 1.0, gpu: 1, xid: 79}          # NVML's event and the kernel's line: one fault
  - {at: 2.0, gpu: 3, kernel_xid: 48}   # the kernel's line only: NVML's event set missed it
"""


def xids_in(path: Path) -> list[tuple[str, int]]:
    out = []
    for raw in path.read_bytes().splitlines():
        if raw and not raw.startswith(b" "):
            x = parse_xid(parse_record(raw))
            assert x is not None
            out.append((x.line.pci, x.code))
    return out


def check_json(*args: str) -> tuple[int, dict[str, object]]:
    r = run("check", "--backend", "mock", "-o", "json", *args)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout)


def reasons(doc: dict[str, object]) -> dict[int, list[str]]:
    gpus = doc["gpus"]
    assert isinstance(gpus, list)
    return {g["index"]: [r.split(":")[0] for r in g["reasons"]] for g in gpus if g["reasons"]}


def test_the_mock_scenario_logs_its_xids_where_check_reads_them(tmp_path: Path) -> None:
    scenario, log = tmp_path / "s.yaml", tmp_path / "kmsg"
    scenario.write_text(SCENARIO)
    log.write_text("stale records of a run before: the scenario's node boots afresh\n")
    code, doc = check_json("--scenario", str(scenario), "--kernel-log", str(log), "--at", "3")
    assert code == 1
    assert reasons(doc) == {1: ["xid-79"], 3: ["xid-48"]}
    assert xids_in(log) == [("0000:02:00", 79), ("0000:04:00", 48)]


def test_without_the_kernel_log_an_xid_only_the_kernel_logged_is_not_seen(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO)
    code, doc = check_json("--scenario", str(scenario), "--at", "3")
    assert code == 1 and reasons(doc) == {1: ["xid-79"]}


def test_the_mock_never_writes_a_kernel_log_that_is_not_a_regular_file(tmp_path: Path) -> None:
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SCENARIO)
    r = run("check", "--backend", "mock", "--scenario", str(scenario), "--kernel-log", "/dev/null")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr == (
        "gpuguard: error: the scenario's kernel log /dev/null: not a regular file (the mock writes it)\n"
    )


def test_check_judges_an_xid_the_kernel_logged_since_boot(fakenvml: Path, tmp_path: Path) -> None:
    """NVML's event set sees no Xid from before it registered: the kernel log does; the preflight fails."""
    s = state_file(tmp_path, "gpu 0 uuid=GPU-0a\ngpu 1 uuid=GPU-0b\n")
    log = KernelLog(tmp_path / "kmsg")
    assert check(fakenvml, s, "--kernel-log", str(log.path))[0] == 0
    log.xid("0000:3c:00", 79, at=3.0)  # the fake's GPU 1, long before this check
    code, doc, _ = check(fakenvml, s, "--kernel-log", str(log.path))
    assert code == 1 and reasons(doc) == {1: ["xid-79"]}, doc


def test_the_fake_librarys_xid_line_is_logged_in_the_kernel_log_and_judged_once(
    fakenvml: Path, tmp_path: Path
) -> None:
    from harness.agentproc import WatchProcess
    from tests.test_nvml_backend import env
    from tests.test_nvml_faults import TWO, reasons_of, watch_until

    s = state_file(tmp_path, TWO + "xid 0 43\n")  # present at the first read: logged by whoever ran then
    log = KernelLog(tmp_path / "kmsg")
    p = WatchProcess(
        "--backend", "nvml", "--dry-run", "--interval", "0.2", "--kernel-log", str(log.path),
        env={**env(fakenvml, s), "FAKE_NVML_KMSG": str(log.path)},
    ).start()  # fmt: skip
    try:
        p.wait_first_check(15)
        s.write_text(TWO + "xid 0 43\nxid 1 79\n")
        doc, _, _ = watch_until(p, lambda d: "xid-79" in reasons_of(d, "GPU-0b"), 6)
        assert reasons_of(doc, "GPU-0b") == ["xid-79"], doc
        watch_until(p, lambda d: p.events("xid.duplicate"), 3)
    finally:
        assert p.stop() == 0, p.lines[-10:]
    assert xids_in(log.path) == [("0000:3c:00", 79)]
    assert [(e["source"], e["xid"]) for e in p.events("xid.duplicate")] in ([("kmsg", 79)], [("nvml", 79)])
