"""The Kubernetes client: the only code that speaks HTTP to the API server.

`kubeconfig` finds the server and the credentials, `client` is the connection pool (TLS, token, JSON, the
errors mapped to `gpuguard.core.errors`), `ratelimit` its client-side token bucket, `listwatch` one collection
kept in memory by a list then a watch. Every request is built here, one module per kind of object: `nodes`,
`devicerules` (ResourceSlices and DeviceTaintRules), `events` (the one Event builder), `pods`; callers pass
what to send and decide what an answer means. Nothing here knows what a quarantine is.
"""
