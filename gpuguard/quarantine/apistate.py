"""The API server as the reconciler last met it, and the few lines an operator reads about it.

A refused request (401, 403, 404, 422: an admission policy's refusal, RBAC, a node that is gone) is
remembered by what it asked for, its intent: the marks on an object for a write (not its bytes: a planned
patch carries a new `gpuguard.io/since` each time), the object for a read. One ERROR line, then that intent is
not sent again for `REFUSAL_BACKOFF` (5 minutes), then once more (a refusal again: one more line); one INFO
line when it is accepted. A refusal within `WARMUP` seconds of an outage's end is retried after
`WARMUP_RETRY` seconds instead: an API server that is starting answers 401/403 until its authorizer has
loaded RBAC (seen in tests/integration/test_agent_cluster.py: a ServiceAccount's `get node` refused 1.5 s
after a restart), and a fault's taint must not wait 5 minutes for that. An API server that does not answer
(a connection error, a timeout, 5xx, 429) is logged once when the outage starts, then every
`OUTAGE_LOG_EVERY` seconds while it lasts, and once when it answers again. /healthz shows the state (`ok`,
`unreachable`, `refused`), since when and the last error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import structlog

from gpuguard.core.errors import NodeUpdateError, PermanentApiError
from gpuguard.core.model import ApiHealth

log = structlog.get_logger(__name__)

# Seconds a refused request is not sent again. A refusal is a policy's or RBAC's answer, not the API server's
# load: sending it again at every check (every 3 s) only fills the audit log. 5 minutes: an operator who
# fixed the policy waits at most that long, and a refusal costs one request and one line per 5 minutes.
REFUSAL_BACKOFF = 300.0
# A refusal this soon after an outage ended may be the API server starting (its RBAC not loaded yet): retried
# after WARMUP_RETRY seconds, not REFUSAL_BACKOFF. At most WARMUP / WARMUP_RETRY requests of a real refusal.
WARMUP = 30.0
WARMUP_RETRY = 2.0
# Seconds between the lines that say the API server is still unreachable: an operator watching the log
# during an outage sees it is still so (and that the agent is alive and retrying) at least this often.
OUTAGE_LOG_EVERY = 30.0
# At most this many refused intents remembered (a node plans a handful of distinct writes).
_MAX_REFUSED = 64


@dataclass(frozen=True)
class Intent:
    """What a request asks for: `verb` and `target` ("patch", "node gpu-1") in its log lines, and `marks`,
    what it would change (the write's content without its time stamps; "" for a read)."""

    verb: str
    target: str
    marks: str = ""

    @property
    def what(self) -> str:
        return f"{self.verb} {self.target}"


class ApiState:
    """Thread-safe: the reconciler's thread writes it, /healthz reads `health`."""

    def __init__(
        self,
        node: str,
        *,
        backoff: float = REFUSAL_BACKOFF,
        outage_every: float = OUTAGE_LOG_EVERY,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._node = node
        self.backoff = backoff
        self._outage_every = outage_every
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        # intent -> (refused until, first refused at: clock)
        self._refused: dict[Intent, tuple[float, float]] = {}
        self._down_since: float | None = None
        self._up_since: float | None = None  # when the last outage ended
        self._down_logged = 0.0
        self._health = ApiHealth()

    @property
    def health(self) -> ApiHealth:
        with self._lock:
            if self._health.state == "refused" and not self._live_refusals():
                self._health = ApiHealth(state="ok", since=self._wall())
            return self._health

    def blocked(self, intent: Intent) -> bool:
        """Whether this intent was refused less than `backoff` seconds ago (then it is not sent)."""
        with self._lock:
            entry = self._refused.get(intent)
            return entry is not None and self._clock() < entry[0]

    def refused(self, intent: Intent, exc: PermanentApiError, *, unwritten: tuple[str, ...] = ()) -> None:
        """One ERROR line for a refused request, and the backoff of its intent. `unwritten`: the faults the
        refusal leaves off the node, named in the line (sent again at once when they change)."""
        now = self._clock()
        with self._lock:
            first = self._refused.get(intent, (0.0, now))[1]
            down, self._down_since = self._down_since, None  # a refusal is an answer: an outage is over
            if down is not None:
                self._up_since = now
            warming = self._up_since is not None and now - self._up_since < WARMUP
            retry_in = min(self.backoff, WARMUP_RETRY) if warming else self.backoff
            self._refused[intent] = (now + retry_in, first)
            if len(self._refused) > _MAX_REFUSED:
                del self._refused[min(self._refused, key=lambda i: self._refused[i][0])]
            self._set("refused", str(exc))
        if down is not None:
            log.info("api.available", node=self._node, down_for_s=round(now - down, 1))
        log.error(
            "node.write_rejected" if intent.verb != "get" else "node.read_rejected",
            node=self._node,
            request=intent.what,
            status=exc.status,
            error=str(exc),
            refused_for_s=round(now - first),
            retry_in_s=round(retry_in),
            faults_unwritten=list(unwritten) or None,
            note="the API server (RBAC or an admission policy) refused it: not sent again before retry_in_s"
            + (
                " (soon: the API server has just come back and may not have loaded RBAC yet)"
                if warming
                else ""
            ),
        )

    def accepted(self, intent: Intent) -> None:
        """A request succeeded: one line if its intent had been refused; the API server answers."""
        now = self._clock()
        with self._lock:
            entry = self._refused.pop(intent, None)
            if intent.verb == "get":
                # A read answered: the object is readable, whatever faults an earlier refused read was for.
                for other in [i for i in self._refused if (i.verb, i.target) == (intent.verb, intent.target)]:
                    entry = entry or self._refused[other]
                    del self._refused[other]
        if entry is not None:
            log.info(
                "node.request_accepted",
                node=self._node,
                request=intent.what,
                refused_for_s=round(now - entry[1]),
                note="refused before, accepted now",
            )
        self.answered()

    def answered(self) -> None:
        """The API server answered (anything but a transient failure): an outage is over."""
        now = self._clock()
        with self._lock:
            down = self._down_since
            self._down_since = None
            if down is not None:
                self._up_since = now
            if self._health.state == "unreachable" or (
                self._health.state == "refused" and not self._live_refusals()
            ):
                self._set("refused" if self._live_refusals() else "ok", self._health.error)
        if down is not None:
            log.info("api.available", node=self._node, down_for_s=round(now - down, 1))

    def unreachable(self, exc: NodeUpdateError) -> None:
        """A request got no usable answer: a line when the outage starts, then every `outage_every`."""
        now = self._clock()
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = self._down_logged = now
                self._set("unreachable", str(exc))
            elif now - self._down_logged >= self._outage_every:
                self._down_logged = now
            else:
                self._set("unreachable", str(exc))
                return
            down_for = now - (self._down_since or now)
        if first:
            log.warning(
                "api.unavailable",
                node=self._node,
                error=str(exc),
                note="retrying; the node's marks are written when the API server answers",
            )
        else:
            log.warning(
                "api.still_unavailable",
                node=self._node,
                down_for_s=round(down_for),
                error=str(exc),
                note="still retrying; checks go on and a fault is written when the API server answers",
            )

    def _set(self, state: str, error: str | None) -> None:
        since = self._health.since if self._health.state == state else self._wall()
        self._health = ApiHealth(state=state, since=since, error=None if state == "ok" else error)

    def _live_refusals(self) -> bool:
        now = self._clock()
        return any(until > now for until, _ in self._refused.values())
