"""The burst's eviction case, short (bench/burst_evict.py SHORT; `make e2e` runs the full size): on the real
scheduler and controller-manager with kwok's GPU nodes, each with a fake kubelet serving PodResources, an
inference Deployment scales from 2 to 36 replicas (more than the 4 nodes hold) and, while some are Pending,
a fatal Xid hits the GPU of a Ready pod on one node and 2 nodes join. With --evict gpu-pods that pod is
evicted and a new replica Runs on another node within a bound; without, it stays bound to the bad node.
Either way the node's other pods keep their UIDs."""

from __future__ import annotations

import pytest

from bench import burst_evict

pytestmark = pytest.mark.timeout(600)

# Fault -> replacement Running, on this 2-core machine under load: the taint, the evictor's round, the
# ReplicaSet, the scheduler's queue (the burst's pending pods first) and kwok.
REPLACED_WITHIN = 60.0


@pytest.fixture(scope="module")
def results(full_control_plane: object) -> dict[str, burst_evict.Result]:
    """Both modes, each on its own control plane (full_control_plane only makes sure kwok is built)."""
    return {r.mode: r for r in burst_evict.run(burst_evict.SHORT, burst_evict.MODES, print)}


def test_with_eviction_the_pod_on_the_failed_gpu_is_replaced_on_another_node_within_a_bound(
    results: dict[str, burst_evict.Result],
) -> None:
    r = results["gpuguard+evict"]
    assert len(r.affected) == burst_evict.SHORT.fault_nodes
    assert r.still_bound == 0 and len(r.evicted_after) == len(r.affected)
    assert len(r.replaced_after) == len(r.affected), r.row()
    assert max(r.replaced_after) < REPLACED_WITHIN, r.row()
    assert r.all_ready is not None


@pytest.mark.parametrize("mode", burst_evict.MODES)
def test_the_gpu_fails_mid_burst_while_replicas_are_still_pending(
    results: dict[str, burst_evict.Result], mode: str
) -> None:
    assert results[mode].bound_at_fault < burst_evict.SHORT.replicas, results[mode].row()


def test_without_eviction_the_pod_stays_bound_to_the_bad_node(results: dict[str, burst_evict.Result]) -> None:
    r = results["gpuguard"]
    assert len(r.affected) == burst_evict.SHORT.fault_nodes
    assert r.still_bound == len(r.affected) and not r.replaced_after and not r.evicted_after, r.row()
    assert r.watched >= burst_evict.SHORT.hold
    assert r.all_ready is None  # stalled: the Deployment counts the pod on the bad GPU as a replica


@pytest.mark.parametrize("mode", burst_evict.MODES)
def test_the_other_pods_of_the_faulty_node_keep_their_uids(
    results: dict[str, burst_evict.Result], mode: str
) -> None:
    r = results[mode]
    assert r.others >= burst_evict.SHORT.ready_pods - 1
    assert r.kept == r.others, r.row()


def test_the_table_says_never_without_eviction_and_the_seconds_with_it(
    results: dict[str, burst_evict.Result],
) -> None:
    rows = burst_evict.table([results["gpuguard"], results["gpuguard+evict"]]).splitlines()
    assert rows[2].startswith("| gpuguard | ") and "never: 1 still on the bad GPU" in rows[2]
    assert rows[3].startswith("| gpuguard+evict | ") and "never" not in rows[3] and "stalled" not in rows[3]
