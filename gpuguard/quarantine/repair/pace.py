"""The cluster-wide pace of resets: a token bucket that refills by itself (no latch an operator must clear),
kept in one Lease every executor reads and replaces with its resourceVersion, so two executors that take
the last token at once cannot both have it (the second meets a 409, reads again and finds none).

The bucket itself is pure (`gpuguard.quarantine.repair.bucket`); `LeasePace` is its home on the API server."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import structlog

from gpuguard.core.errors import ConflictError
from gpuguard.core.validation import PREFIX
from gpuguard.kube import client as kubeclient
from gpuguard.kube import leases
from gpuguard.quarantine.repair.bucket import Bucket, take
from gpuguard.quarantine.repair.values import parse_time, stamp

log = structlog.get_logger(__name__)

ANN_TOKENS = f"{PREFIX}repair-tokens"
ANN_AT = f"{PREFIX}repair-tokens-at"


class LeasePace:
    """The bucket in Lease `namespace/name`."""

    def __init__(
        self,
        api: Callable[[], kubeclient.Client],
        bucket: Bucket,
        *,
        namespace: str,
        name: str = "gpuguard-repair-pace",
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        tries: int = 5,
    ) -> None:
        self._api, self._bucket, self._ns, self._name = api, bucket, namespace, name
        self._now, self._tries = now, tries

    def take(self) -> bool:
        for _ in range(self._tries):
            api = self._api()
            lease = leases.read(api, self._ns, self._name)
            ann = ((lease or {}).get("metadata") or {}).get("annotations") or {}
            try:
                tokens: float | None = float(ann.get(ANN_TOKENS, ""))
            except ValueError:
                tokens = None
            now = self._now()
            ok, left = take(self._bucket, tokens, parse_time(ann.get(ANN_AT)), now)
            if not ok:
                return False
            values = {ANN_TOKENS: f"{left:.3f}", ANN_AT: stamp(now)}
            try:
                if lease is None:
                    leases.create(api, self._ns, self._name, values)
                else:
                    leases.replace(api, lease, values)
            except ConflictError:
                log.info("repair.pace_conflict", lease=f"{self._ns}/{self._name}")
                continue
            return True
        return False
