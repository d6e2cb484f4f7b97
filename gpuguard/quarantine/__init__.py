"""The quarantines: the only code that writes to Kubernetes (gpuguard's taint, cordon, annotations, label,
condition and Events on its own node, and its DeviceTaintRules). Two quarantines side by side, and what
drives them:

- `node`: the node quarantine (taint and cordon) and the cluster-wide budget: the node as read and the change
  to make (`view`), the pure planner (`plan`), the budget's arithmetic, order and gate (`budget`), the API
  server and dry-run writers (`writers`) and the budget kept in memory off the fault's path (`budgetwatch`).
- `gpu`: the per-GPU quarantine (DRA DeviceTaintRules): the node's published GPUs (`slices`), the rules as
  read and written (`rules`), what is trusted of them (`trust`), the GPUs' place in the budget (`order`,
  `budget`), the state across reconciles (`quarantine`), its sources (`writers`) and the rules' watch
  (`watch`).
- `reconciler`: the thread that applies the newest verdict to both: retries, 409 re-plans, the condition,
  Events; `apistate`: what the API server last answered.
"""
