"""The backend `watch` and `check` read the GPUs through, built from the settings: the mock (a scenario) or
NVML, with the kernel log beside it when --kernel-log names one (docs/design.md, "The kernel log")."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuguard.core.config import Config
from gpuguard.nvml.base import Backend

if TYPE_CHECKING:
    from gpuguard.core.metrics import Metrics


def make_backend(
    cfg: Config,
    *,
    start_at: float = 0.0,
    metrics: Metrics | None = None,
    judged: Callable[[], int | None] = lambda: None,
    once: bool = False,
) -> Backend:
    """The mock (a scenario, its clock started at `start_at`; a bad one fails here, before anything starts) or
    NVML; with --kernel-log, the kernel's Xids added (`judged`: the last record judged in this boot; `once`:
    the log read whole at each snapshot, for `check`)."""
    backend: Backend
    if cfg.backend == "mock":
        from gpuguard.nvml.mock import MockBackend, MockKernelLog, load_scenario  # noqa: PLC0415

        scenario = load_scenario(cfg.scenario)
        # The scenario's driver logs its Xids where the agent reads them (a stand-in file, never /dev/kmsg).
        kernel = MockKernelLog(cfg.kernel_log) if scenario.kernel_log and cfg.kernel_log else None
        backend = MockBackend(scenario, start_at=start_at, kernel_log=kernel)
    else:
        from gpuguard.nvml.real import NvmlBackend  # noqa: PLC0415 - pynvml only when asked for

        backend = NvmlBackend(deadline=cfg.nvml_call_timeout, pci_root=cfg.pci_root)
    if not cfg.kernel_log:
        return backend
    from gpuguard.nvml.kmsg.merge import kernel_log_backend  # noqa: PLC0415

    return kernel_log_backend(backend, cfg.kernel_log, metrics=metrics, judged=judged, once=once)
