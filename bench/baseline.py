"""The baseline for `make bench`: what the seed design would do, on the same fake NVML library and the same
API server as gpuguard, so the latency ratio in docs/performance.md is measured, not claimed.

The seed design: one loop that polls every `--interval` seconds through pynvml; no event thread, so an Xid is
seen only at the next poll (the Xid event set is drained with a 0 ms wait at each poll); when an uncorrected
ECC count is non-zero or an Xid is pending, it taints the node with a plain strategic-merge patch (read the
node, send its taint list plus ours, no resourceVersion precondition); when a poll reads healthy again it
removes the taint the same way. It keeps no memory of an Xid beyond the poll that saw it.

    LD_LIBRARY_PATH=build/fakenvml FAKE_NVML_STATE=... python -m bench.baseline --node N --kubeconfig K

Prints one JSON line {"event": "ready"} on stdout after its first poll. Its User-Agent is
`seed-baseline/1`, so the audit log never counts its requests as gpuguard's.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any

TAINT_KEY = "gpuguard.io/gpu-unhealthy"
USER_AGENT = "seed-baseline/1"


class Baseline:
    def __init__(self, node: str, kubeconfig: str, interval: float) -> None:
        import kubernetes
        import pynvml

        self.nvml: Any = pynvml
        self.node = node
        self.interval = interval
        api: Any = kubernetes.config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        api.user_agent = USER_AGENT
        self.core: Any = kubernetes.client.CoreV1Api(api)
        self.stop = threading.Event()
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.events = pynvml.nvmlEventSetCreate()
        for h in self.handles:
            pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self.events)
        self.tainted = self._our_taint(self._read()) is not None

    def _read(self) -> dict[str, Any]:
        resp = self.core.read_node(self.node, _preload_content=False, _request_timeout=10)
        return json.loads(resp.data)  # type: ignore[no-any-return]

    @staticmethod
    def _our_taint(node: dict[str, Any]) -> dict[str, Any] | None:
        taints = (node.get("spec") or {}).get("taints") or []
        return next((t for t in taints if t.get("key") == TAINT_KEY), None)

    def _drain_xids(self) -> list[int]:
        codes: list[int] = []
        while True:
            try:
                data = self.nvml.nvmlEventSetWait_v2(self.events, 0)
            except self.nvml.NVMLError_Timeout:
                return codes
            codes.append(int(data.eventData))

    def poll(self) -> None:
        nvml = self.nvml
        xids = self._drain_xids()
        ecc = [
            int(
                nvml.nvmlDeviceGetTotalEccErrors(
                    h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            )
            for h in self.handles
        ]
        unhealthy = bool(xids) or any(e > 0 for e in ecc)
        if unhealthy == self.tainted:
            return
        node = self._read()
        taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") != TAINT_KEY]
        if unhealthy:
            reason = f"xid-{xids[0]}" if xids else "ecc"
            taints.append({"key": TAINT_KEY, "value": reason, "effect": "NoSchedule"})
        self.core.patch_node(
            self.node,
            {"spec": {"taints": taints}},
            _content_type="application/strategic-merge-patch+json",
            # The admission policy admits no other manager's managedFields entry from the agents' token.
            field_manager="gpuguard",
            _preload_content=False,
            _request_timeout=10,
        )
        self.tainted = unhealthy

    def run(self) -> None:
        first = True
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self.poll()
            except Exception as exc:  # the seed logged and carried on
                print(json.dumps({"event": "poll_failed", "error": repr(exc)}), file=sys.stderr, flush=True)
            if first:
                print(json.dumps({"event": "ready"}), flush=True)
                first = False
            self.stop.wait(max(0.0, started + self.interval - time.monotonic()))
        self.nvml.nvmlEventSetFree(self.events)
        self.nvml.nvmlShutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--node", required=True)
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--interval", type=float, default=3.0)
    args = ap.parse_args(argv)
    loop = Baseline(args.node, args.kubeconfig, args.interval)
    signal.signal(signal.SIGTERM, lambda *_: loop.stop.set())
    loop.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
