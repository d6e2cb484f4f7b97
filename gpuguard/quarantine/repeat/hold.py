"""An operator's hold of one GPU, as the annotation `gpuguard.io/hold` carries it from `gpuguard hold` to the
agent: the GPU is held for repair as a repeat offender is (its quarantine stays across reboots and resets)
until `gpuguard release`. For the case where the agent's own history lost a hold (a rollback that moved a
newer history file aside) or an operator knows better than the count. Pure.

The same three fields as a release (`release.parse`: size, JSON, a printable `by`, a time not ahead of the
node), with `gpu` one GPU UUID, never "*": a hold names what it holds. The admission policy keeps the agents'
own tokens from writing it, as it does a release: a stolen token must not hold (or lift) GPUs for repair.
"""

from __future__ import annotations

from datetime import datetime

from gpuguard.quarantine.record import DOMAIN
from gpuguard.quarantine.repeat import release
from gpuguard.quarantine.repeat.release import ALL, ReleaseRequest

ANN_HOLD = f"{DOMAIN}/hold"


def parse(text: str, *, now: float) -> ReleaseRequest:
    """The hold the annotation asks for; ValueError (a one-line reason) when it is not one."""
    request = release.parse(text, now=now)
    if request.gpu == ALL:
        raise ValueError('"gpu" must name one GPU UUID: a hold of "*" is not one')
    return request


def annotation(gpu: str, *, by: str, at: datetime) -> str:
    """The annotation's value that `parse` accepts (the CLI's side)."""
    return release.annotation(gpu, by=by, at=at)
