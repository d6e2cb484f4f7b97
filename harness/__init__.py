"""What the tests and the benchmarks run gpuguard with: one importable package, shared by tests/ and bench/
without a ``sys.path`` edit (pytest runs from the repository root, the benchmarks as ``python -m bench.X``
from it, and both find this package there).

- ``controlplane``: a real, throwaway etcd + kube-apiserver (``make kube-up`` runs it as a CLI).
- ``agentproc``: ``gpuguard watch`` as a subprocess (scrubbed environment, JSON log lines, /healthz).
- ``kube``: a real API server's admin (nodes, tokens, the DaemonSet's ServiceAccount) and the agent on it.
- ``dra``: DRA ResourceSlices and device names as the NVIDIA driver publishes them.
- ``dracluster``: DRA on a real API server: the DeviceClass, a claim template, a node whose GPUs are
  published, the device a pod was allocated, a DeviceTaintRule.
- ``repairrig``: the repair executor beside the agent, as the repair's integration test and
  ``bench.repair`` run it.
- ``fakes``: in-memory stand-ins for the node writer and the device source, a small HTTP server, a TLS pair.
- ``clock``: the one fake clock, which moves only when the test moves it.
- ``kubelet``: a fake kubelet, a real gRPC server on a unix socket serving the PodResources API v1.
"""
