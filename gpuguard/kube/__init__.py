"""The Kubernetes client: the only code that speaks HTTP to the API server.

`kubeconfig` finds the server and the credentials, `client` is the connection pool (TLS, token, JSON, the
errors mapped to `gpuguard.core.errors`), `ratelimit` its client-side token bucket, `listwatch` one collection
kept in memory by a list then a watch. Nothing here knows what a quarantine is.
"""
