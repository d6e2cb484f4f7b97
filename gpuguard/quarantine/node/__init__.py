"""The node quarantine: gpuguard's taint, cordon, annotations and label on its own node, and the cluster-wide
budget that caps how many nodes are fully quarantined at once.

- `view`: the keys gpuguard owns, `Taint`, `NodeView` (the node as read) and `NodeChange` (one write).
- `plan`: pure. Given the node and the policy's verdict, the change to make, or None when the node already
  matches (the idempotence every restart relies on). Always plans the full quarantine.
- `budget`: the cluster-wide quarantine budget: its arithmetic, the quarantine order, the pure gate that
  turns a full quarantine into the deferred one, and the budget's state across reconciles. Reads the fleet
  through its own narrow `BudgetSource`, never through a writer.
- `writers`: the API server (`KubeNodeWriter`) and the dry run (`DryRunNodeWriter`); `make_writer` picks.
- `budgetwatch`: the budget's inputs kept in memory off the fault's path (a watch of the quarantined nodes
  and a background GPU-node count), so that a fault costs only its own writes; the writer's lists as
  fallback.
"""
