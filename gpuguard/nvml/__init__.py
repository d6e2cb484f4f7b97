"""GPU backends: they report readings and decide nothing (see gpuguard.judge.policy for the decisions)."""

from gpuguard.nvml.base import Backend, Wakeup

__all__ = ["Backend", "Wakeup"]
