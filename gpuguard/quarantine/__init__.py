"""The quarantines: the only code that writes to Kubernetes (gpuguard's taint, cordon, annotations, label,
condition and Events on its own node, and its DeviceTaintRules). Two quarantines side by side, independent of
each other, what they share below them, and what drives them above (docs/design.md, "Layers"):

- `node`: the node quarantine (taint and cordon) and the cluster-wide budget that gates it: the node as read
  and the change to make (`view`), the pure planner (`plan`), the budget's arithmetic, order and gate
  (`budget`), the API server and dry-run writers (`writers`) and the budget kept in memory (`budgetwatch`).
- `gpu`: the per-GPU quarantine (DRA DeviceTaintRules), the same shape: the node's published GPUs (`slices`),
  the rules as read and written (`rules`), the pure decisions (`plan`), what is trusted of the rules read
  (`trust`), the GPUs' place in the budget (`order`, `budget`), the rules' durable memory (`memory`), the
  state across reconciles (`quarantine`), its sources (`writers`) and the rules' watch (`watch`).
- shared: the fault record both carry (`record.FaultRecord`), the budget both count against (`budget`), what
  the API server last answered (`apistate`).
- `reconciler`: the thread that applies the newest verdict to both: the node as last read, retries, 409
  re-plans; the verdict's hand-off (`handoff`) and the condition, Events and log lines (`nodereport`).
"""
