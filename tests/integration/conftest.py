"""Fixtures that run integration tests against a real kube-apiserver (hack/testenv).

The control plane code lives in ``harness/controlplane.py`` (shared with ``make kube-up`` and the bench).

By default the session starts its own control plane (state in a pytest temp dir, so a
``make kube-up`` cluster is left alone) and stops it at the end. With
``GPUGUARD_KUBECONFIG_REUSE=1`` and a live cluster described by ``.kube-test/state.json``
(``make kube-up``), that cluster is used and left running, which makes repeated runs fast.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import kubernetes
import pytest

from harness import controlplane

REUSE_ENV = "GPUGUARD_KUBECONFIG_REUSE"


def _reuse_requested() -> bool:
    return os.environ.get(REUSE_ENV, "") == "1"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build kube-apiserver/etcd before the first test starts.

    Why here and not in the fixture: a cold build takes many minutes, and pytest-timeout's
    per-test limit also covers the fixture setup of the first test that needs them.
    """
    if session.config.option.collectonly:
        return
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    if "oldest" in used:
        _build_before_tests(session, controlplane.OLDEST)
    planes = {"control_plane", "full_control_plane", "karpenter_control_plane"}
    planes |= {"beta_only_plane", "no_rules_plane"}  # test_device_versions.py's own (--runtime-config)
    if not used & planes:
        return
    if used & {"full_control_plane", "karpenter_control_plane"} and controlplane.kwok_cached() is None:
        try:
            controlplane.kwok_binary()  # hack/kwok/build.sh: progress on stderr, a few minutes cold
        except controlplane.ControlPlaneError as e:
            print(f"kwok build failed: {e}", file=sys.stderr)
    if "karpenter_control_plane" in used and controlplane.karpenter_cached() is None:
        try:
            controlplane.karpenter_binary()  # hack/karpenter/build.sh: about 5 minutes cold
        except controlplane.ControlPlaneError as e:
            print(f"Karpenter build failed: {e}", file=sys.stderr)
    _build_before_tests(session, controlplane.NEWEST)


def _build_before_tests(session: pytest.Session, release: str) -> None:
    if controlplane.cached_binaries(release) is not None:
        return
    if (
        release == controlplane.NEWEST
        and _reuse_requested()
        and controlplane.ControlPlane.attach() is not None
    ):
        return
    reporter: Any = session.config.pluginmanager.getplugin("terminalreporter")
    capman: Any = session.config.pluginmanager.getplugin("capturemanager")
    if reporter is not None:
        reporter.write_line(
            f"building kube-apiserver and etcd, {release} release (hack/testenv/build.sh; cold: minutes)"
        )
    try:
        if capman is not None:
            with capman.global_and_fixture_disabled():
                controlplane.build(release=release)
        else:
            controlplane.build(quiet=True, release=release)
    except controlplane.ControlPlaneError as e:
        # The fixture reports the missing binaries to every test that needs them.
        if reporter is not None:
            reporter.write_line(f"build failed: {e}", red=True)


@pytest.fixture(scope="session")
def control_plane(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[controlplane.ControlPlane]:
    """A running etcd + kube-apiserver for the whole session (reused when asked to)."""
    if _reuse_requested():
        running = controlplane.ControlPlane.attach()
        if running is not None:
            yield running
            return
    # The build ran in pytest_collection_finish; building here would hit the test timeout.
    cp = controlplane.ControlPlane(
        tmp_path_factory.mktemp("kube-test"), allow_build=False, die_with_parent=True
    )
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def full_control_plane(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[controlplane.ControlPlane]:
    """A second control plane with kube-scheduler, kube-controller-manager and kwok as well, for the tests
    where pods are scheduled, run and evicted. Separate from control_plane: there the tests' bare Node
    objects would be marked unreachable by the node life-cycle controller, and their pods collected."""
    cp = controlplane.ControlPlane(
        tmp_path_factory.mktemp("kube-full"),
        allow_build=False,
        die_with_parent=True,
        components=controlplane.COMPONENTS,
    )
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def karpenter_control_plane(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[controlplane.ControlPlane]:
    """full_control_plane's components plus Karpenter's kwok provider (tests/integration/test_karpenter.py),
    on a control plane of their own: Karpenter launches nodes for every pending pod, and other tests leave
    pods pending on purpose."""
    cp = controlplane.ControlPlane(
        tmp_path_factory.mktemp("kube-karpenter"),
        allow_build=False,
        die_with_parent=True,
        components=(*controlplane.COMPONENTS, controlplane.KARPENTER),
    )
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def admin_api(control_plane: controlplane.ControlPlane) -> Iterator[kubernetes.client.ApiClient]:
    """A kubernetes.client.ApiClient authenticated as cluster admin (system:masters)."""
    client: kubernetes.client.ApiClient = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(control_plane.kubeconfig_path)
    )
    with closing(client):
        yield client
