"""What `gpuguard check` takes from its Node object, in one read: the GPU count of --expected-gpus-label
(gpuguard.runtime.gpucount) and the labels that select --signals-config's node rules
(gpuguard.core.signalconfig), so that a preflight judges a signal as `watch` on the same node would.

The node is read when a cluster is named and the check knows its node (gpucount's rule), and only for what
needs it: the count when neither --expected-gpus is given nor the container sees a share of the node's GPUs,
the labels when the --signals-config file has node rules. Nothing read here can fail the check by itself:
without the labels (no cluster, no node name, an API that does not answer) the global part of
--signals-config applies, and one line (`check.signals_global_only`) says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from gpuguard.core.config import Config
from gpuguard.core.signaltable import SignalTable
from gpuguard.runtime import gpucount

if TYPE_CHECKING:
    from gpuguard.kube import client as kubeclient

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class NodeFacts:
    expected_gpus: int | None
    """--expected-gpus, else the label's count, else None (no expectation)."""
    signals: SignalTable
    """The signals for this node: --signals-config's global part, then the node rules its labels select."""


def read(cfg: Config, *, api: kubeclient.Client | None = None) -> NodeFacts:
    """The node's facts for `check`, from at most one GET of the Node."""
    node = cfg.node.name or ""
    config = cfg.signals_config
    want_rules = config is not None and bool(config.rules)
    want_count = cfg.policy.expected_gpus is None and bool(cfg.expected_gpus_label) and bool(node)
    cluster = bool(node) and gpucount.cluster_named(cfg.node.kubeconfig)
    if want_count and cluster and gpucount.sees_a_share():
        log.info(
            "check.expected_gpus_label_skipped",
            node=node,
            why="NVIDIA_VISIBLE_DEVICES lists this container's GPUs, not the node's",
        )
        want_count = False
    labels = None
    if cluster and (want_count or want_rules):
        labels = gpucount.node_labels(node, kubeconfig=cfg.node.kubeconfig, api=api)
    expected = cfg.policy.expected_gpus
    if want_count and labels is not None:
        expected = gpucount.expected_from_labels(labels, node=node, label=cfg.expected_gpus_label)
    signals = cfg.policy.signals
    if config is not None and want_rules:
        if labels is None:
            # A warning: the file has node rules an operator meant for this node, and they are not applied.
            log.warning(
                "check.signals_global_only",
                node=node or None,
                why="the node's labels are unknown (no cluster named, no --node, or no answer from the API)",
                action="--signals-config's global part applies, not its node rules",
            )
        else:
            signals = config.table(labels)
            log.info("check.signals_node_rules", node=node, rules=list(config.matching(labels)))
    return NodeFacts(expected_gpus=expected, signals=signals)
