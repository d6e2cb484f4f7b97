"""The kubelet's PodResources API (v1): which devices each container on this node was given. The only code
that speaks gRPC (an import contract says so): `client` reads List and Get over the kubelet's unix socket,
under a deadline, with the errors mapped to `gpuguard.core.errors`; `v1` holds the official proto and the
stubs grpcio-tools generated from it (`make podresources-stubs`)."""
