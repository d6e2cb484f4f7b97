"""The repair's end-to-end case (`make e2e`, after the burst's): time from a fault to the GPU back in
service, beside the time to a replacement pod.

On its own control plane (kube-apiserver, kube-scheduler, kube-controller-manager, kwok: the fuller test
control plane), with every admission policy of deploy/ and the executor's RBAC: 8 replicas on the 8 DRA
GPUs of a node, a spare node, the real agent (`--repair on`) on the fake NVML library, the repair executor
as its own ServiceAccount with a stand-in reset command that resets the fake GPU, and a fake kubelet that
forgets an evicted pod. GPU_RESET is written to GPU 3; measured from then: its DeviceTaintRule, the agent's
request, the executor's proof, the rule gone (GPU 3 back in the ResourceSlice's schedulable set), and the
evicted pod's replacement Ready on the spare node (the same run as tests/integration/test_repair.py).

The model, stated: the reset is a stand-in (seconds on real hardware: nvidia-smi resets an H100 in a few
seconds; an HGX board's GPUs need Fabric Manager), and the pods start at once (kwok).

    python -m bench.repair
"""

from __future__ import annotations

import tempfile
from contextlib import closing
from pathlib import Path
from typing import Any

import kubernetes

from harness import controlplane
from harness.agentproc import ROOT
from harness.dracluster import dra_objects
from harness.kube import Admin, with_workloads
from harness.repairrig import apply_repair_rbac, reset_gpu_3, scene


def main() -> int:
    lib = ROOT / "build" / "fakenvml"
    with tempfile.TemporaryDirectory(prefix="gpuguard-repair-") as tmp:
        work = Path(tmp)
        cp = controlplane.ControlPlane(work / "cp", components=controlplane.COMPONENTS, die_with_parent=True)
        cp.start()
        try:
            api: Any = kubernetes.config.new_client_from_config(config_file=str(cp.kubeconfig_path))  # type: ignore[no-untyped-call]
            with closing(api):
                admin = with_workloads(Admin(api))
                apply_repair_rbac(admin)
                dra_objects(admin)
                with scene(admin, cp, lib=lib, work=work, sock=str(work / "kubelet.sock")) as s:
                    t = reset_gpu_3(s)
        finally:
            cp.stop()
    print("## One GPU reset while its seven neighbours serve (`make e2e`)\n")
    print("| from the fault (GPU_RESET on GPU 3) to | seconds |")
    print("|---|---|")
    for what, seconds in (
        ("its DeviceTaintRule", t.rule),
        ("the agent's repair request", t.requested),
        ("the executor's proof (pod evicted, idle twice, reset, proven)", t.proven),
        ("GPU 3 back in service (its rule gone)", t.back),
        ("the evicted pod's replacement Ready on another node", t.replaced),
    ):
        print(f"| {what} | {seconds:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
