"""Evicting the pods that hold a faulty GPU (--evict gpu-pods): `plan` decides which pods go (pure), `evictor`
is the thread that asks the kubelet (gpuguard.kube.podresources) and the API server (gpuguard.kube.pods) and
evicts them through the Eviction API, so PodDisruptionBudgets hold."""
