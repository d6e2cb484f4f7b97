"""Flapping in seconds (gpuguard.judge.flaps): a condition back within --flap-window of its last episode
flaps until it has stayed away a whole window, and a flapping degraded signal's clean streak is held at 0
(the node's, and each GPU's own), so its marks stay."""

from __future__ import annotations

import pytest

from gpuguard.core.model import Fault, GpuVerdict, Streaks, Verdict
from gpuguard.judge.flaps import Flap, Flaps, flapping, held, observe, observe_verdict


def seen(*samples: tuple[float, bool], window: float = 60.0) -> Flap:
    flap = Flap()
    for at, present in samples:
        flap = observe(flap, present, at, window)
    return flap


@pytest.mark.parametrize(
    ("samples", "now", "want"),
    [
        (((0, True),), 1, False),
        (((0, True), (1, False), (2, True)), 2, True),
        (((0, True), (1, False), (2, True), (3, False)), 61, True),
        (((0, True), (1, False), (2, True), (3, False)), 62.5, False),
        (((0, True), (1, False), (100, True)), 100, False),
        (((0, True), (0.1, True), (0.2, True), (0.3, True)), 0.3, False),
    ],
    ids=[
        "one episode is no flap",
        "back within the window flaps",
        "it flaps until a whole window after it was last seen",
        "a whole window away ends the flap",
        "back after the window is a new first episode",
        "a condition seen at many checks is one episode, however often the agent looked",
    ],
)
def test_a_condition_flaps_when_it_comes_back_within_the_window(
    samples: tuple[tuple[float, bool], ...], now: float, want: bool
) -> None:
    assert flapping(seen(*samples), now, 60.0) is want


def _gpus(degraded_uuid: str | None) -> Verdict:
    nvlink = Fault("nvlink-down", "link 3", uuid=degraded_uuid, gpu_index=0)
    return Verdict(
        gpus=tuple(
            GpuVerdict(index=i, uuid=u, degraded=(nvlink,) if u == degraded_uuid else ())
            for i, u in enumerate(["GPU-0", "GPU-1"])
        )
    )


def test_a_flapping_gpus_clean_streak_is_held_and_its_neighbours_is_not() -> None:
    flaps = Flaps()
    for at, who in [(0.0, "GPU-0"), (1.0, None), (2.0, "GPU-0"), (3.0, None)]:
        flaps = observe_verdict(flaps, _gpus(who), at, 60.0)
    streaks = Streaks(healthy=4, clean=2, gpus_clean={"GPU-0": 2, "GPU-1": 4})
    assert held(streaks, flaps, 3.0, 60.0) == Streaks(healthy=4, clean=0, gpus_clean={"GPU-0": 0, "GPU-1": 4})
    assert held(streaks, flaps, 63.5, 60.0) == streaks  # a whole window away: counted again


@pytest.mark.parametrize(
    ("samples", "now", "want"),
    [
        (((0, True), (1, False), (10, True), (11, False), (70, True)), 70, True),
        (((0, True), (1, False), (2, True), (3, False)), 62, False),
    ],
    ids=["an episode exactly a window old still counts", "a window exactly after the last sighting ends it"],
)
def test_the_window_holds_its_last_instant_and_the_flap_ends_a_whole_window_after_it(
    samples: tuple[tuple[float, bool], ...], now: float, want: bool
) -> None:
    assert flapping(seen(*samples), now, 60.0) is want


def test_episodes_never_seen_present_are_no_flap() -> None:
    assert not flapping(Flap(episodes=(0.0, 1.0)), 2.0, 60.0)


def test_the_nodes_faults_flap_as_the_verdict_is_unhealthy() -> None:
    ecc = Fault("ecc", "2 uncorrected", uuid="GPU-0", gpu_index=0)
    sick = Verdict(gpus=(GpuVerdict(index=0, uuid="GPU-0", faults=(ecc,)),))
    flaps = observe_verdict(Flaps(), sick, 0.0, 60.0)
    assert flaps.faults.present and flaps.faults.episodes == (0.0,)
    assert not observe_verdict(flaps, _gpus(None), 1.0, 60.0).faults.present


def _flapping() -> Flap:
    return seen((0, True), (1, False), (2, True), (3, False))


@pytest.mark.parametrize(
    ("flaps", "held_streaks"),
    [
        (Flaps(gpus_degraded={"GPU-0": _flapping()}), Streaks(clean=2, gpus_clean={"GPU-0": 0, "GPU-1": 4})),
        (Flaps(degraded=_flapping()), Streaks(clean=0, gpus_clean={"GPU-0": 2, "GPU-1": 4})),
        (Flaps(), Streaks(clean=2, gpus_clean={"GPU-0": 2, "GPU-1": 4})),
    ],
    ids=["a gpu's alone", "the node's alone", "none"],
)
def test_each_flapping_signal_holds_its_own_clean_streak_alone(flaps: Flaps, held_streaks: Streaks) -> None:
    streaks = Streaks(clean=2, gpus_clean={"GPU-0": 2, "GPU-1": 4})
    assert held(streaks, flaps, 3.0, 60.0) == held_streaks
