"""Prometheus metrics. The registry is injected (the CLI passes the default one; tests their own)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from gpuguard import __version__
from gpuguard.core.errors import NodeUpdateError, PermanentApiError
from gpuguard.core.model import Verdict


@contextmanager
def counted(metrics: Metrics | None, verb: str) -> Iterator[None]:
    """One Kubernetes API request in gpuguard_api_requests_total{verb,code} (the error's status, or 200); a
    refused one (a 4xx other than 409) also in gpuguard_api_refused_total{verb,code}."""
    try:
        yield
    except NodeUpdateError as exc:
        if metrics is not None:
            metrics.api_requests.labels(verb, str(exc.status or "error")).inc()
            if isinstance(exc, PermanentApiError):
                metrics.api_refused.labels(verb, str(exc.status or "error")).inc()
        raise
    if metrics is not None:
        metrics.api_requests.labels(verb, "200").inc()


class Metrics:
    def __init__(self, registry: CollectorRegistry, *, dry_run: bool = False) -> None:
        """dry_run: the node gauges carry dry_run="true": what the agent would have done, so alerts can be
        rehearsed before enforcing (select dry_run="false" for the real thing)."""
        self.registry = registry
        self._dry_run = "true" if dry_run else "false"
        self.gpu_healthy = Gauge(
            "gpuguard_gpu_healthy",
            "1 if the GPU is healthy, 0 if not.",
            ["gpu", "uuid"],
            registry=registry,
        )
        self.ecc = Gauge(
            "gpuguard_gpu_ecc_uncorrected_volatile",
            "Volatile uncorrected ECC error count (absent where ECC is not applicable).",
            ["gpu", "uuid"],
            registry=registry,
        )
        self.xids = Counter(
            "gpuguard_xid_events_total",
            "Critical Xid events seen.",
            ["gpu", "uuid", "xid", "ignored"],
            registry=registry,
        )
        self.remap_pending = Gauge(
            "gpuguard_gpu_row_remap_pending",
            "1 while a remapped row waits for a GPU reset to take effect (absent without row remapping).",
            ["gpu", "uuid"],
            registry=registry,
        )
        self.retired_pages = Gauge(
            "gpuguard_gpu_retired_pages",
            "Pages retired by dynamic page retirement (pre-Ampere GPUs; absent where not applicable).",
            ["gpu", "uuid"],
            registry=registry,
        )
        # The health signals' PCIe link, shown (a generation below the device's is an idle GPU saving power).
        self.pcie_generation = Gauge(
            "gpuguard_gpu_pcie_link_generation",
            "The PCIe link's current generation, as last read (every 30 s; absent where not read).",
            ["gpu", "uuid"],
            registry=registry,
        )
        self.pcie_width = Gauge(
            "gpuguard_gpu_pcie_link_width",
            "The PCIe link's current width in lanes, as last read (every 30 s; absent where not read).",
            ["gpu", "uuid"],
            registry=registry,
        )
        self.xid_watched = Gauge(
            "gpuguard_gpu_xid_watched",
            "1 while the agent is registered for the GPU's Xid events, 0 while it is not (blind to Xids).",
            ["gpu", "uuid"],
            registry=registry,
        )
        self._quarantined = Gauge(
            "gpuguard_node_quarantined",
            '1 while gpuguard\'s taint is on the node (dry_run="true": would be).',
            ["dry_run"],
            registry=registry,
        )
        self._quarantine_deferred = Gauge(
            "gpuguard_node_quarantine_deferred",
            "1 while the quarantine budget is spent and this node has only the soft taint "
            '(dry_run="true": would have).',
            ["dry_run"],
            registry=registry,
        )
        self._gpus_quarantined = Gauge(
            "gpuguard_gpus_quarantined",
            "GPUs of this node held out of service by gpuguard's DRA DeviceTaintRules (the per-GPU "
            'quarantine; not counting rules deferred by the budget; dry_run="true": would be).',
            ["dry_run"],
            registry=registry,
        )
        self._gpus_deferred = Gauge(
            "gpuguard_gpus_quarantine_deferred",
            "Faulty GPUs of this node whose DeviceTaintRule the quarantine budget deferred: they stay in "
            'service (dry_run="true": would).',
            ["dry_run"],
            registry=registry,
        )
        self.gpus_quarantined = self._gpus_quarantined.labels(self._dry_run)
        self.gpus_deferred = self._gpus_deferred.labels(self._dry_run)
        self.quarantined = self._quarantined.labels(self._dry_run)
        self.quarantine_deferred = self._quarantine_deferred.labels(self._dry_run)
        self.check_duration = Histogram(
            "gpuguard_check_duration_seconds",
            "Time of one check (read every GPU and evaluate).",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        self.kernel_log_skipped = Counter(
            "gpuguard_kernel_log_records_skipped_total",
            "Kernel-log records not judged: malformed, oversized, or lost (overwritten before being read).",
            ["why"],
            registry=registry,
        )
        self.api_requests = Counter(
            "gpuguard_api_requests_total",
            "Kubernetes API requests made.",
            ["verb", "code"],
            registry=registry,
        )
        self.api_refused = Counter(
            "gpuguard_api_refused_total",
            "Kubernetes API requests refused (401, 403, 404, 422: RBAC, an admission policy); each refused "
            "request is sent again at most once per 5 minutes.",
            ["verb", "code"],
            registry=registry,
        )
        self.api_dropped = Counter(
            "gpuguard_api_objects_dropped_total",
            "Objects the API server sent that a read dropped unread, by read: larger than its cap "
            "(gpuguard.kube.client.MAX_OBJECT, a rule's MAX_RULE_BYTES), treated as absent.",
            ["read"],
            registry=registry,
        )
        self.api_retries = Counter(
            "gpuguard_api_retries_total",
            "Kubernetes API requests retried after a transient failure.",
            registry=registry,
        )
        self.last_check = Gauge(
            "gpuguard_last_check_timestamp_seconds",
            "Unix time of the last completed check.",
            registry=registry,
        )
        self.nvml_stuck = Gauge(
            "gpuguard_nvml_stuck_calls",
            "NVML calls that have not returned within their deadline and are still in flight (one stuck "
            "thread each; the GPU is gpu-unresponsive, or the node nvml-unresponsive).",
            registry=registry,
        )
        self._stuck_value = 0
        self.gpu_degraded = Gauge(
            "gpuguard_gpu_degraded",
            "1 for each degraded signal a GPU has now (the second level: shown and scheduled around "
            'softly, never a quarantine); gpu="" and uuid="" for a signal of the node. The series goes when '
            "the signal clears.",
            ["gpu", "uuid", "reason"],
            registry=registry,
        )
        self._degraded_series: frozenset[tuple[str, str, str]] = frozenset()
        # --evict gpu-pods (gpuguard.eviction): one per eviction asked of the API server, by its answer.
        self.pod_evictions = Counter(
            "gpuguard_pod_evictions_total",
            "Evictions of pods that hold a faulty GPU, by result: evicted; blocked (a PodDisruptionBudget "
            "said no: retried with backoff while the fault holds); gone (the pod left first); failed (the "
            "API server did not answer or refused: retried); dry-run (logged, not sent).",
            ["result"],
            registry=registry,
        )
        # Repeat offenders: the GPUs held for repair (quarantine.escalation).
        self.repeat_offender = Gauge(
            "gpuguard_gpu_repeat_offender",
            "Fault episodes of a GPU held as a repeat offender (absent when not held): its quarantine stays "
            "across reboots and resets until an operator's `gpuguard release`.",
            ["gpu", "uuid"],
            registry=registry,
        )
        self._repeat_values: dict[tuple[str, str], int] = {}
        self.build = Info("gpuguard_build", "gpuguard build information.", registry=registry)
        self.build.info({"version": __version__})
        self._gpu_values: dict[
            tuple[str, str], tuple[int, int, int | None, bool | None, int | None, tuple[int, int] | None]
        ] = {}
        self._observed: Verdict | None = None
        self._node_values: tuple[int, int, int, int] | None = None

    def object_dropped(self, read: str) -> None:
        self.api_dropped.labels(read).inc()

    def observe_check(self, verdict: Verdict, *, duration: float, wall: float) -> None:
        self.check_duration.observe(duration)
        self.last_check.set(wall)
        if verdict is not self._observed:
            self._observe_gpus(verdict)
        if verdict.ignored_xids or verdict.fatal_xids:
            for x, ignored in [(x, "true") for x in verdict.ignored_xids] + [
                (x, "false") for x in verdict.fatal_xids
            ]:
                gpu = "" if x.gpu_index is None else str(x.gpu_index)
                self.xids.labels(gpu, x.uuid or "", str(x.code), ignored).inc()

    def observe_stuck(self, calls: int) -> None:
        if calls != self._stuck_value:
            self._stuck_value = calls
            self.nvml_stuck.set(calls)

    def observe_node(
        self, quarantined: int, deferred: int, gpus_quarantined: int, gpus_deferred: int = 0
    ) -> None:
        """The node's quarantine gauges, set when they change (only this method sets them)."""
        values = (quarantined, deferred, gpus_quarantined, gpus_deferred)
        if values == self._node_values:
            return
        self._node_values = values
        self.quarantined.set(values[0])
        self.quarantine_deferred.set(values[1])
        self.gpus_quarantined.set(values[2])
        self.gpus_deferred.set(values[3])

    def _observe_degraded(self, verdict: Verdict) -> None:
        """gpuguard_gpu_degraded: one series per (GPU, signal) degraded now; the cleared ones removed."""
        series = frozenset(
            ("" if f.gpu_index is None else str(f.gpu_index), f.uuid or "", f.reason)
            for f in verdict.degraded
        )
        if series == self._degraded_series:
            return
        for labels in self._degraded_series - series:
            self.gpu_degraded.remove(*labels)
        for labels in series - self._degraded_series:
            self.gpu_degraded.labels(*labels).set(1)
        self._degraded_series = series

    def _observe_gpus(self, verdict: Verdict) -> None:
        # The same verdict object as at the last check (the agent's remembered evaluation) has the same
        # per-GPU values: nothing to look at.
        self._observed = verdict
        self._observe_degraded(verdict)
        for g in verdict.gpus:
            labels = (str(g.index), g.uuid)
            values = (
                1 if g.healthy else 0,
                1 if g.xid_watched else 0,
                g.ecc_uncorrected,
                g.remap_pending,
                g.retired_pages,
                g.pcie_link,
            )
            # Only this method sets these gauges: a GPU whose values did not change since the last check
            # needs no label lookups (most of a healthy check's metrics cost).
            if self._gpu_values.get(labels) == values:
                continue
            self._gpu_values[labels] = values
            self.gpu_healthy.labels(*labels).set(values[0])
            self.xid_watched.labels(*labels).set(values[1])
            if g.ecc_uncorrected is not None:
                self.ecc.labels(*labels).set(g.ecc_uncorrected)
            if g.remap_pending is not None:
                self.remap_pending.labels(*labels).set(1 if g.remap_pending else 0)
            if g.retired_pages is not None:
                self.retired_pages.labels(*labels).set(g.retired_pages)
            if g.pcie_link is not None:
                self.pcie_generation.labels(*labels).set(g.pcie_link[0])
                self.pcie_width.labels(*labels).set(g.pcie_link[1])

    def observe_repeat_offenders(self, held: Mapping[str, int], index: Mapping[str, int]) -> None:
        """The held GPUs (UUID -> episodes; `index`: UUID -> GPU index where known); a GPU released is
        removed from the gauge."""
        values = {(str(index[u]) if u in index else "", u): n for u, n in held.items()}
        if values == self._repeat_values:
            return
        for labels in set(self._repeat_values) - set(values):
            self.repeat_offender.remove(*labels)
        for labels, n in values.items():
            self.repeat_offender.labels(*labels).set(n)
        self._repeat_values = values
