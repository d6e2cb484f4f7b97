"""Integration tests against a real etcd + kube-apiserver (see hack/testenv)."""
