"""gpuguard: a node-level GPU health agent for Kubernetes."""

__version__ = "0.1.0"
