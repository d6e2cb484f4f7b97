"""The per-GPU quarantine with DRA device taints (KEP-5055): a fault that belongs to one GPU becomes one
DeviceTaintRule for that device, where the node's GPUs are published in ResourceSlices (docs/design.md,
"Per-GPU quarantine: DRA device taints")."""
