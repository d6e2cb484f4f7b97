"""How many GPUs `gpuguard check` expects, from its node's label when it runs where it can read one.

Why the label NVIDIA GPU Feature Discovery writes (`nvidia.com/gpu.count`, `--expected-gpus-label`) and not
the node's `status.capacity["nvidia.com/gpu"]`: a label stays on the Node object across a reboot, so a
preflight that runs before GPU Feature Discovery relabels the node still sees the count from before, the
one a GPU that did not come back falls short of. The capacity is the device plugin's live enumeration
(kubelet zeroes extended resources when it restarts, until the plugin registers again): it follows a lost
GPU instead of remembering it. An operator who has a better source (an instance type's GPU count, such as
Karpenter's `karpenter.k8s.aws/instance-gpu-count`) names that label instead.

The node is read only when a cluster is named (in-cluster, --kubeconfig or $KUBECONFIG) and the check knows
its node (--node or NODE_NAME, the downward API), and never when --expected-gpus is given (the flag wins).
Nothing read here can fail the check by itself: an API that does not answer, a node without the label, or a
value that is not a bounded count (anyone who can write the node's labels could write anything there) is
logged and leaves the check without an expectation, as without the label.
"""

from __future__ import annotations

import os
import re

import structlog

from gpuguard.core import validation
from gpuguard.core.config import GPU_COUNT_LABEL
from gpuguard.core.errors import GpuguardError
from gpuguard.kube import client as kubeclient
from gpuguard.kube import nodes

log = structlog.get_logger(__name__)

# The most GPUs one node can be expected to hold: NVIDIA's largest nodes hold 8 or 16; a value past this is
# not a count, and the label's own syntax allows 63 characters.
MAX_GPUS = 1024
# A preflight waits at most this long for the node (one read, no retry): a slow API server must not hold a
# pod's start for long, and the check judges the GPUs without the label anyway.
READ_TIMEOUT_S = 3.0
_COUNT = re.compile(r"^[0-9]{1,4}$")


def parse_count(value: object) -> int | None:
    """The label's value as a count of GPUs, 1..MAX_GPUS; None for anything else."""
    if not isinstance(value, str) or not _COUNT.match(value):
        return None
    count = int(value)
    return count if 1 <= count <= MAX_GPUS else None


def cluster_named(kubeconfig: str | None) -> bool:
    """Whether a cluster is named: --kubeconfig, $KUBECONFIG or in-cluster. A laptop's ~/.kube/config is not
    read for this (a demo `check` must not wait on a dead server)."""
    return bool(kubeconfig or os.environ.get("KUBECONFIG") or os.environ.get("KUBERNETES_SERVICE_HOST"))


def sees_a_share() -> bool:
    """Whether this container sees only the GPUs allocated to it (the device plugin's NVIDIA_VISIBLE_DEVICES
    lists them): the node's count is then not what NVML can show here."""
    visible = os.environ.get("NVIDIA_VISIBLE_DEVICES")
    return visible is not None and visible.strip() not in ("", "all")


def node_labels(
    node: str, *, kubeconfig: str | None, api: kubeclient.Client | None = None
) -> dict[str, str] | None:
    """`node`'s labels in one read (the one `check` makes: its GPU count and --signals-config's node rules
    both come from it); None, with the line `check.node_unread`, when the API does not answer."""
    try:
        client = api if api is not None else kubeclient.load(kubeconfig)
        obj = nodes.read(client, node, timeout=READ_TIMEOUT_S)
    except GpuguardError as exc:
        log.warning(
            "check.node_unread",
            node=node,
            error=str(exc),
            action="judged without the node's labels (its GPU count, --signals-config's node rules)",
        )
        return None
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    labels = metadata.get("labels") if isinstance(metadata, dict) else None
    if not isinstance(labels, dict):
        return {}
    return {str(k): v for k, v in labels.items() if isinstance(v, str)}


def expected_from_labels(labels: dict[str, str], *, node: str, label: str = GPU_COUNT_LABEL) -> int | None:
    """The count `label` holds among a node's labels; None (with a log line saying why) otherwise."""
    value = labels.get(label)
    if value is None:
        log.info("check.expected_gpus_label_absent", node=node, label=label)
        return None
    count = parse_count(value)
    if count is None:
        log.warning(
            "check.expected_gpus_label_invalid",
            node=node,
            label=label,
            value=validation.printable(str(value)[:64]),
            expected=f"an integer 1..{MAX_GPUS}",
            action="ignored",
        )
        return None
    log.info("check.expected_gpus_from_label", node=node, label=label, expected_gpus=count)
    return count
