"""gpuguard's error hierarchy. Adapters raise these where the library's codes are known
(`gpuguard.kube.client` maps HTTP statuses and connection failures itself), with `raise ... from
exc`; only the CLI maps them to exit codes.

    GpuguardError
    ├── ConfigError            bad flag, env value or file: exit 2, one line, no traceback
    │   └── ScenarioError      malformed mock scenario (names the event)
    ├── BackendError           a backend could not be used at all (not a GPU fault: those are readings)
    └── NodeUpdateError        a Kubernetes read or write failed (status: the HTTP status, None if no answer)
        ├── TransientApiError  connection error, timeout, 5xx, 429: retried with backoff
        │   (retry_after: seconds the server asked us to wait, if it said)
        ├── ConflictError      409: the node changed under us; re-read and re-plan
        └── PermanentApiError  any other 4xx: logged once, not retried in a loop
    KubeletError               the kubelet's PodResources API (gpuguard.kube.podresources) could not answer
    ├── KubeletUnavailable     no socket, nothing listening, a deadline passed: retried at the next check
    └── KubeletUnsupported     the kubelet does not serve the API (gRPC UNIMPLEMENTED): nothing to retry
"""

from __future__ import annotations


class GpuguardError(Exception):
    """Base of every error gpuguard raises on purpose."""


class ConfigError(GpuguardError):
    pass


class ScenarioError(ConfigError):
    pass


class BackendError(GpuguardError):
    pass


class NodeUpdateError(GpuguardError):
    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class TransientApiError(NodeUpdateError):
    def __init__(self, message: str, *, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, status=status)
        self.retry_after = retry_after


class ConflictError(NodeUpdateError):
    def __init__(self, message: str, *, status: int | None = 409) -> None:
        super().__init__(message, status=status)


class PermanentApiError(NodeUpdateError):
    pass


class KubeletError(GpuguardError):
    pass


class KubeletUnavailable(KubeletError):
    pass


class KubeletUnsupported(KubeletError):
    pass
