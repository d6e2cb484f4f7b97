"""The kernel log (/dev/kmsg) as a second source of Xids: the records parsed (`records`), read on a thread of
their own (`reader`), and merged with NVML's into the snapshot, each Xid once (`merge`)."""
