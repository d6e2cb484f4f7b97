"""bench/burst_evict.py's bookkeeping without a cluster: the fake kubelets' table (device i -> the i-th pod
bound on a node; a pod that leaves frees its GPU) and the table's cells (never a number for a pod that was
never replaced)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from bench import burst_evict
from bench.burst_evict import DeviceWatch, Result, table
from harness.kubelet import FakeKubelet


def pod(name: str, node: str | None, *, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-05T09:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node} if node else {}, "status": {}}


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    folder = tempfile.mkdtemp(prefix="kubelet-", dir="/tmp")
    k = FakeKubelet(f"{folder}/k.sock")  # not started: only its table is read
    yield k
    shutil.rmtree(folder, ignore_errors=True)


def held(kubelet: FakeKubelet) -> dict[str, list[str]]:
    return {p.name: p.containers[0].devices["nvidia.com/gpu"] for p in kubelet.pods}


def test_device_i_goes_to_the_ith_pod_bound_and_a_pod_that_leaves_frees_its_gpu(kubelet: FakeKubelet) -> None:
    watch = DeviceWatch(object(), {"n1": kubelet})
    watch._observe([pod("b", "n1"), pod("a", "n1"), pod("p", None), pod("x", "n2")], 1.0)
    assert held(kubelet) == {"a": ["GPU-0"], "b": ["GPU-1"]}  # bound in one list: by name
    watch._observe([pod("a", "n1", deleting=True), pod("b", "n1"), pod("c", "n1")], 2.0)
    assert held(kubelet) == {"a": ["GPU-0"], "b": ["GPU-1"], "c": ["GPU-2"]}  # terminating: still there
    assert watch.deleting == {"a": 2.0} and watch.gone == {"x": 2.0}  # a pod never bound is not tracked
    watch._observe([pod("b", "n1"), pod("c", "n1"), pod("d", "n1")], 3.0)
    assert held(kubelet) == {"b": ["GPU-1"], "c": ["GPU-2"], "d": ["GPU-0"]}
    assert watch.gone["a"] == 3.0 and watch.uid["d"] == "uid-d"


def test_the_table_says_never_for_a_pod_not_replaced_and_the_seconds_for_one_replaced() -> None:
    without = Result("gpuguard", 340, ["a", "b"], 320, still_bound=2, others=14, kept=14, watched=30.2)
    with_ = Result(
        "gpuguard+evict", 340, ["a", "b"], 320, [2.21, 3.14], [0.3, 0.31], others=14, kept=14, all_ready=19.5
    )
    half = Result("gpuguard+evict", 340, ["a", "b"], 320, [2.2], [0.3, 0.3], still_bound=1, watched=31.0)
    rows = table([without, with_, half]).splitlines()
    assert rows[2] == (
        "| gpuguard | 2 (Xid 79; 320 of 340 pods bound) | never: 2 still on the bad GPU 30 s after the fault "
        "| - | 14/14 | stalled |"
    )
    assert (
        rows[3]
        == "| gpuguard+evict | 2 (Xid 79; 320 of 340 pods bound) | 2.2, 3.1 s | 0.3, 0.3 s | 14/14 | 19.5 s |"
    )
    assert "| 2.2 s; never: 1 still on the bad GPU 31 s after the fault |" in rows[4]


def test_the_full_case_scales_past_the_nodes_gpus_and_fits_the_good_ones() -> None:
    """The fault comes while replicas are Pending only if the nodes cannot hold them all; the burst can end
    only if the good GPUs (the joiners' included) can."""
    for case in (burst_evict.FULL, burst_evict.SHORT):
        gpus = 8 * case.nodes
        assert case.replicas > gpus
        assert case.replicas <= 8 * (case.nodes - case.fault_nodes + case.joiners)
