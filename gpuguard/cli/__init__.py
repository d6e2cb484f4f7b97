"""Command line: `gpuguard watch` (the daemon), `gpuguard check` (one pass, a preflight), `gpuguard version`,
`gpuguard status`, `gpuguard release`, `gpuguard hold`, `gpuguard history` and `gpuguard uninstall` (the
operator's, on the cluster), `gpuguard explain` (why a node's GPUs were taken: its evidence, on the node or
from the cluster), `gpuguard repair-executor` (the repair executor, a container of its own).

The only package that reads flags and the environment: each flag declared once in `flags` (its default is
its settings field's), the settings built from them in `settings`, the commands in `commands`, `cluster`,
`explain`, `holding` and `history`.
Every flag can also come from env `GPUGUARD_<FLAG_NAME>` (e.g. GPUGUARD_INTERVAL); --node also from
NODE_NAME (the downward API). Exit codes: 0 ok/healthy, 1 unhealthy (check), 2 usage or configuration error:
one line, no traceback; 3 no NVML library; 4 (status, release, hold, history, uninstall) the API server is
unreachable or refused the request.
"""

from gpuguard.cli.cluster import release, status, uninstall
from gpuguard.cli.commands import (
    DEFAULT_LISTEN,
    EXIT_API,
    EXIT_NO_NVML,
    EXIT_OK,
    EXIT_UNHEALTHY,
    EXIT_USAGE,
    NO_NVML_HINT,
    check,
    cli,
    main,
    version,
    watch,
)
from gpuguard.cli.explain import explain
from gpuguard.cli.flag import from_environment
from gpuguard.cli.history import history
from gpuguard.cli.holding import hold
from gpuguard.cli.repairing import repair_executor

from_environment(cli)

__all__ = [
    "DEFAULT_LISTEN",
    "EXIT_API",
    "EXIT_NO_NVML",
    "EXIT_OK",
    "EXIT_UNHEALTHY",
    "EXIT_USAGE",
    "NO_NVML_HINT",
    "check",
    "cli",
    "explain",
    "history",
    "hold",
    "main",
    "release",
    "repair_executor",
    "status",
    "uninstall",
    "version",
    "watch",
]
