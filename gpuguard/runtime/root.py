"""The composition root: builds the backend, the writer, the budget, the reconciler, the agent and the HTTP
server from one `Config`, and runs them. The CLI parses flags into the Config and calls in here."""

from __future__ import annotations

import gc
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import FrameType
from typing import TYPE_CHECKING, Protocol

import structlog

from gpuguard.core import files, logs
from gpuguard.core.config import Config, NodeSettings
from gpuguard.core.errors import ConfigError
from gpuguard.core.model import AgentStatus, Verdict
from gpuguard.judge.policy import evaluate
from gpuguard.runtime import health
from gpuguard.runtime.backends import make_backend

if TYPE_CHECKING:  # the watch's parts: imported where they are built, not by `check`
    from prometheus_client import CollectorRegistry

    from gpuguard.core.metrics import Metrics
    from gpuguard.eviction.evictor import Evictor
    from gpuguard.kube import client as kubeclient
    from gpuguard.quarantine.gpu.quarantine import DeviceQuarantine
    from gpuguard.quarantine.gpu.watch import WatchedRules
    from gpuguard.quarantine.gpu.writers import DryRunDeviceSource, KubeDeviceSource
    from gpuguard.quarantine.node.budget import QuarantineBudget
    from gpuguard.quarantine.node.budgetwatch import WatchedBudget
    from gpuguard.quarantine.node.writers import DryRunNodeWriter, KubeNodeWriter
    from gpuguard.quarantine.reconciler import NodeReconciler
    from gpuguard.quarantine.repeat.offenders import RepeatOffenders
    from gpuguard.runtime import checknode
    from gpuguard.runtime.agent import Agent
    from gpuguard.runtime.evidence import EvidenceRecorder

log = structlog.get_logger(__name__)


# A host up for less than this is a new (or just rebooted) node: its agent reads the node at once, because the
# startup gate and the scale-out wait for it. The herd the jitter is for is a DaemonSet installed or rolled
# on nodes that have been up for a while; a new node's agent starts within a few minutes of its boot.
FRESH_BOOT_S = 600.0


def startup_delay(
    cfg: Config, *, uptime: float | None, draw: Callable[[float, float], float] = random.uniform
) -> float:
    """The reconciler's start-up delay: 0..--startup-jitter, except in a dry run (no requests) and on a host
    that booted within FRESH_BOOT_S (uptime None, unreadable: the jitter applies)."""
    if cfg.node.dry_run or cfg.node.startup_jitter <= 0:
        return 0.0
    if uptime is not None and uptime < FRESH_BOOT_S:
        return 0.0
    return draw(0.0, cfg.node.startup_jitter)


def host_uptime(path: str = "/proc/uptime") -> float | None:
    """Seconds since the host booted (/proc/uptime is the host's, also in a container); None if unreadable."""
    try:
        return float(files.read_text(path, limit=4 * files.KIB, what="uptime file").split()[0])
    except (ConfigError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Check:
    verdict: Verdict
    # libnvidia-ml.so.1 could not be loaded at all (and --allow-no-gpu was not given): check exits 3.
    no_library: bool


def check_once(cfg: Config, *, at: float | None = None) -> Check:
    """One pass over the GPUs (`gpuguard check`); `at`: a mock scenario as it stands that many seconds in."""
    if at is not None and cfg.backend != "mock":
        raise ConfigError("--at needs --backend mock: it moves a scenario's clock, not a real GPU's")
    node = node_facts(cfg)
    policy = replace(cfg.policy, expected_gpus=node.expected_gpus, signals=node.signals)
    # With --kernel-log, the Xids since boot are judged like NVML's: a preflight after a fatal one fails.
    backend = make_backend(cfg, start_at=at or 0.0, once=True)
    backend.open(lambda: None)
    try:
        snapshot = backend.snapshot()
    finally:
        backend.close()
    # The fabric's grace runs from the boot: a preflight does not wait it out. A mock scenario's node boots
    # when the scenario starts (`--at` seconds ago).
    uptime = host_uptime() if cfg.backend == "nvml" else at or 0.0
    now = time.monotonic()
    snapshot = replace(snapshot, taken_at=now, booted_at=None if uptime is None else now - uptime)
    # One pass: an unreadable or unidentified GPU fails the preflight at once (watch waits 3 checks).
    verdict = evaluate(snapshot, previous=None, settings=replace(policy, unreadable_after=1))
    no_library = snapshot.init_error == "LIBRARY_NOT_FOUND" and not cfg.policy.allow_no_gpu
    return Check(verdict=verdict, no_library=no_library)


def node_facts(cfg: Config) -> checknode.NodeFacts:
    """What `check` takes from its node in one read where it can (gpuguard.runtime.checknode): the GPU count
    it
    expects and the signal table --signals-config's node rules give it."""
    from gpuguard.runtime import checknode  # noqa: PLC0415 - the API client only where a node is read

    return checknode.read(cfg)


class Connection:
    """The agent's one client to the API server, made at its first use and then shared by everything that
    sends a request (the node writer, the device source, the budget's and the rules' watches), so that one
    client-side rate limit (--api-qps, --api-burst) holds all of the agent's requests; `dropped` counts the
    objects its reads drop. An unusable kubeconfig raises at each use (gpuguard.core.errors)."""

    def __init__(self, settings: NodeSettings, dropped: Callable[[str], None] | None = None) -> None:
        self._settings, self._dropped = settings, dropped
        self._client: kubeclient.Client | None = None
        self._lock = threading.Lock()

    def __call__(self) -> kubeclient.Client:
        from gpuguard.kube import client as kubeclient  # noqa: PLC0415 - not for `check`
        from gpuguard.kube.ratelimit import RateLimiter  # noqa: PLC0415

        with self._lock:
            if self._client is None:
                s = self._settings
                limit = RateLimiter(s.api_qps, s.api_burst)
                self._client = kubeclient.load(s.kubeconfig, rate_limiter=limit, dropped=self._dropped)
            return self._client


class Background(Protocol):
    """A thread of its own beside the agent's loop: a watch of the fleet, the evictor."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class Parts:
    """What `watch` runs, built from one Config by `build` (tests and the bench build it the same way)."""

    agent: Agent
    reconciler: NodeReconciler
    metrics: Metrics
    writer: KubeNodeWriter | DryRunNodeWriter
    budget: QuarantineBudget
    fleet: WatchedBudget | None
    device_source: KubeDeviceSource | DryRunDeviceSource | None
    devices: DeviceQuarantine | None
    rules_watch: WatchedRules | None
    delay: float
    evictor: Evictor | None = None
    evidence: EvidenceRecorder | None = None

    @property
    def background(self) -> list[Background]:
        """What runs beside the agent's loop, in the order started: the fleet's watches, the evictor, the
        evidence recorder."""
        return [b for b in (self.fleet, self.rules_watch, self.evictor, self.evidence) if b is not None]

    def status(self) -> AgentStatus:
        """The agent's status plus what the device source found (which DeviceTaintRule API is served)."""
        s = self.agent.status()
        if self.device_source is None:
            return s
        return replace(s, device_taint_api=self.device_source.api_version)


def build(cfg: Config, *, registry: CollectorRegistry | None = None) -> Parts:
    """Every part of `watch` from one Config, wired: nothing started, no request sent."""
    from prometheus_client import REGISTRY  # noqa: PLC0415

    from gpuguard.core.metrics import Metrics  # noqa: PLC0415
    from gpuguard.quarantine.apistate import ApiState  # noqa: PLC0415
    from gpuguard.quarantine.gpu.quarantine import DeviceQuarantine  # noqa: PLC0415
    from gpuguard.quarantine.gpu.watch import WatchedRules  # noqa: PLC0415
    from gpuguard.quarantine.gpu.writers import KubeDeviceSource, make_device_source  # noqa: PLC0415
    from gpuguard.quarantine.node.budget import QuarantineBudget  # noqa: PLC0415
    from gpuguard.quarantine.node.budgetwatch import watched  # noqa: PLC0415
    from gpuguard.quarantine.node.writers import DRY_RUN_NODE, make_writer  # noqa: PLC0415
    from gpuguard.quarantine.reconciler import NodeReconciler  # noqa: PLC0415
    from gpuguard.runtime.agent import Agent  # noqa: PLC0415
    from gpuguard.store.baselines import BaselineStore  # noqa: PLC0415
    from gpuguard.store.state import StateStore, read_boot_id  # noqa: PLC0415

    metrics = Metrics(REGISTRY if registry is None else registry, dry_run=cfg.node.dry_run)
    connect = Connection(cfg.node, metrics.object_dropped)
    writer = make_writer(cfg.node, connect, metrics)
    # What the API server answered, one view for the reconciler and the budget's watch (/healthz "api").
    api_state = ApiState(cfg.node.name or DRY_RUN_NODE, backoff=cfg.node.refusal_backoff)
    fleet = watched(
        cfg.node, writer, api_state
    )  # the budget off the fault's path: a watch and a background count
    budget_source = fleet or writer
    budget = QuarantineBudget(budget_source, cfg.node)
    # The start-up jitter (--startup-jitter): a fleet started at once reaches the API server spread out.
    uptime = host_uptime()
    delay = startup_delay(cfg, uptime=uptime)
    state = baselines = None
    if cfg.state_dir and cfg.node.dry_run:
        # A dry run writes nothing, on the host either: a fault it kept would be restored, and written to
        # the node, by the enforcing run that follows it on the same host.
        log.info("state.off", directory=cfg.state_dir, note="a dry run keeps no durable fault state")
    elif cfg.state_dir:
        state = StateStore(cfg.state_dir, boot_id=read_boot_id(cfg.boot_id_file), backend=cfg.backend)
        # The signals' first-good baselines beside it (not in a dry run: it writes nothing on the host).
        baselines = BaselineStore(cfg.state_dir, backend=cfg.backend)
    # With --kernel-log a second source of Xids, on a thread of its own (docs/design.md, "The kernel log").
    judged = state.kernel_seq if state is not None else lambda: None
    backend = make_backend(cfg, metrics=metrics, judged=judged)
    devices = device_source = rules_watch = None
    if cfg.node.quarantine != "node":
        node_name = cfg.node.name or ""
        device_source = make_device_source(cfg.node, connect, metrics)
        if isinstance(device_source, KubeDeviceSource) and not cfg.node.max_quarantined.unlimited:
            # Every gpuguard rule for the budget, from memory: no list in the fault's path.
            source = device_source
            rules_watch = WatchedRules(
                node_name,
                api=source.api,
                fallback=source.all_rules,
                path=lambda: source.rules_path,
                timeout=cfg.node.api_timeout,
            )
        devices = DeviceQuarantine(
            device_source,
            cfg.node,
            budget=lambda: budget_source.budget(cfg.node.max_quarantined, exclude=node_name),
            order=budget_source.quarantine_order,
            memory=state,
            all_rules=rules_watch.all_rules if rules_watch is not None else None,
        )
        if rules_watch is not None:
            devices.on_devices = rules_watch.found
    reconciler = NodeReconciler(
        writer,
        cfg.node,
        budget=budget,
        devices=devices,
        metrics=metrics,
        start_delay=delay,
        api=api_state,
        repeat=repeat_offenders(cfg, durable=state is not None),
    )
    evictor = make_evictor(cfg, connect, reconciler, metrics)
    from gpuguard.runtime.evidence import recorder  # noqa: PLC0415 - the evidence kept at detection, in --state-dir

    evidence = recorder(cfg, lambda: reconciler.status) if state is not None else None
    observers = [o.observe for o in (evictor, evidence) if o is not None]

    def observe(verdict: Verdict) -> None:
        for o in observers:
            o(verdict)

    agent = Agent(
        backend=backend,
        reconciler=reconciler,
        policy=cfg.policy,
        interval=cfg.interval,
        node_name=cfg.node.name,
        dry_run=cfg.node.dry_run,
        metrics=metrics,
        state=state,
        baselines=baselines,
        flap_window=cfg.node.flap_window,
        library_wait=None if cfg.backend != "nvml" or cfg.policy.allow_no_gpu else cfg.nvml_load_timeout,
        call_wait=float(getattr(backend, "longest_wait", 0.0)),
        on_verdict=observe if observers else None,
        signal_config=cfg.signals_config,
        uptime=uptime if cfg.backend == "nvml" else 0.0,  # a mock scenario's node boots with it
        recover_after=cfg.node.recover_after,
    )
    return Parts(
        agent=agent,
        reconciler=reconciler,
        metrics=metrics,
        writer=writer,
        budget=budget,
        fleet=fleet,
        device_source=device_source,
        devices=devices,
        rules_watch=rules_watch,
        delay=delay,
        evictor=evictor,
        evidence=evidence,
    )


def make_evictor(
    cfg: Config, connect: Connection, reconciler: NodeReconciler, metrics: Metrics
) -> Evictor | None:
    """The evictor of --evict gpu-pods (gpuguard.eviction), None otherwise. It sees what the quarantine does
    through the reconciler's status: the GPUs' DeviceTaintRules (a NoExecute one makes kube-controller-manager
    evict: gpuguard does not) and the node taint."""
    if cfg.node.evict == "none":
        return None
    if cfg.node.name is None:
        log.warning("eviction.off", why="a dry run without --node: no node whose pods to read")
        return None
    from gpuguard.eviction import evictor as ev  # noqa: PLC0415
    from gpuguard.eviction.plan import Faulty  # noqa: PLC0415
    from gpuguard.kube.podresources.client import PodResourcesClient  # noqa: PLC0415 - grpc only when evicting

    node, s = cfg.node.name, cfg.node

    def context() -> Faulty:
        status = reconciler.status
        held = [g for g in status.gpus if not g.deferred]
        return Faulty(
            frozenset(),
            dra_devices={
                **(reconciler.devices.published if reconciler.devices is not None else {}),
                **{g.uuid: (s.dra_driver, node, g.device) for g in status.gpus},
            },
            ruled=frozenset(g.uuid for g in status.gpus),
            dra_noexecute=frozenset(g.uuid for g in held if g.effect == "NoExecute"),
            taint_effect=s.taint_effect,
            node_noexecute=status.tainted and not status.deferred and s.taint_effect == "NoExecute",
            deferred=frozenset(g.uuid for g in status.gpus if g.deferred),
            node_deferred=status.deferred,
            node_tainted=status.tainted,
        )

    return ev.Evictor(
        ev.Settings(node=node, grace_period=s.evict_grace_period, dry_run=s.dry_run, timeout=s.api_timeout),
        kubelet=PodResourcesClient(s.pod_resources_socket, timeout=s.api_timeout),
        api=connect,
        context=context,
        settled=reconciler.wait_idle,
        metrics=metrics,
    )


def watch(cfg: Config) -> bool:
    """`gpuguard watch`: until SIGTERM/SIGINT or --run-for. True when it stopped because libnvidia-ml.so.1
    never became loadable within --nvml-load-timeout (the CLI exits 3 so kubelet restarts the container)."""
    # Imported here, not above: `gpuguard check` (an initContainer preflight) needs none of them.
    from prometheus_client import REGISTRY  # noqa: PLC0415

    from gpuguard.runtime.server import HealthServer  # noqa: PLC0415

    logs.configure(cfg.log_format)
    parts = build(cfg, registry=REGISTRY)
    agent = parts.agent
    try:
        server = HealthServer(parts.status, host=cfg.server.host, port=cfg.server.port, registry=REGISTRY)
    except OSError as exc:
        raise ConfigError(f"--listen {cfg.server.host}:{cfg.server.port}: {exc.strerror}") from None
    server.start()
    log.info("server.listening", host=server.host, port=server.port)
    if parts.delay > 0:
        log.info("node.startup_jitter", node=cfg.node.name, delay_s=round(parts.delay, 3))

    def _stop(signum: int, frame: FrameType | None) -> None:
        agent.stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
    background = parts.background
    for b in background:
        b.start()
    if parts.evictor is not None:
        log.info("eviction.on", node=cfg.node.name, grace_period_s=cfg.node.evict_grace_period)
    # Everything made so far lives as long as the process: out of the collector's sight, so that a full
    # collection in a fault's path walks only what came after, not the tens of thousands of objects of the
    # imports and the start-up.
    gc.collect()
    gc.freeze()
    try:
        agent.run(run_for=cfg.run_for)
    finally:
        for b in background:
            b.stop()
        server.stop()
    if cfg.node.dry_run:
        log.info("agent.dry_run_summary", summary=health.dry_run_summary(parts.status()))
    return agent.no_library


def repeat_offenders(cfg: Config, *, durable: bool) -> RepeatOffenders:
    """The GPU history and its repeat offenders: in --state-dir where the fault state is kept
    there, else in memory only (a dry run, no state directory)."""
    from gpuguard.quarantine.repeat.escalation import AT_ONCE_CHECKS, Limits  # noqa: PLC0415
    from gpuguard.quarantine.repeat.offenders import RepeatOffenders  # noqa: PLC0415
    from gpuguard.store.history import HistoryStore  # noqa: PLC0415

    store = HistoryStore(cfg.state_dir if durable else None)
    limits = Limits(
        limit=cfg.node.repeat_limit,
        window_s=cfg.node.repeat_window,
        at_once_s=AT_ONCE_CHECKS * cfg.interval,
    )
    return RepeatOffenders(store, limits, recover_after=cfg.node.recover_after)
