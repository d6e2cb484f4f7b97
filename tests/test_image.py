"""The image the Dockerfile builds, built and run by the tests (hack/image/build.sh, tests/imagerun.py):
as the image's own user (65532, numeric, so kubelet can verify runAsNonRoot), on a read-only root filesystem,
`gpuguard version`, `gpuguard check --backend mock` and a dry-run `watch` answering /healthz, stopped by
SIGTERM as PID 1.

The base is a Debian bookworm stand-in for python:3.11-slim-bookworm (no registry is reachable here; see
hack/image/build.sh); everything above the base is the Dockerfile's own steps. GPUGUARD_SKIP_IMAGE=1 skips.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard import __version__
from tests.imagerun import Image, free_port, is_root, mounted, pid1_of

ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = ROOT / "hack" / "image" / "build.sh"

pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    if os.environ.get("GPUGUARD_SKIP_IMAGE") == "1":
        pytest.skip("GPUGUARD_SKIP_IMAGE=1")
    if not is_root():
        pytest.fail(
            "the image tests need root (debootstrap, buildah, mount namespaces); GPUGUARD_SKIP_IMAGE=1 skips"
        )
    try:
        result = subprocess.run(
            [str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=1400, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hack/image/build.sh did not finish in {exc.timeout} s")
    if result.returncode != 0:
        pytest.fail(f"hack/image/build.sh failed ({result.returncode}):\n{result.stderr[-3000:]}")
    with mounted(result.stdout.strip().splitlines()[-1]) as img:
        yield img


def test_the_image_runs_as_numeric_uid_65532_with_gpuguard_as_entrypoint(image: Image) -> None:
    assert image.config["User"] == "65532:65532"
    assert image.config["Entrypoint"] == ["gpuguard"]
    assert image.config["Cmd"] == ["watch"]
    assert "9847/tcp" in image.config.get("ExposedPorts", {})


def test_the_root_filesystem_is_read_only_and_the_process_is_not_root(image: Image) -> None:
    probe = (
        "import os\ntry:\n open('/opt/venv/x', 'w')\n"
        "except OSError as e:\n print(os.getuid(), os.getgid(), e.errno)"
    )
    result = image.run(["-c", probe], entrypoint=["python"], timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["65532", "65532", "30"]  # 30: EROFS


def test_gpuguard_version_in_the_image_is_the_package_version(image: Image) -> None:
    result = image.run(["version"], timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"gpuguard {__version__}"


def test_check_with_the_mock_backend_reports_eight_healthy_gpus(image: Image) -> None:
    result = image.run(["check", "--backend", "mock"], timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("Mock GPU") == 8
    assert result.stdout.strip().endswith("healthy")


def test_check_in_the_image_shows_the_demo_fault_at_6_seconds(image: Image) -> None:
    result = image.run(["check", "--backend", "mock", "--at", "6"], timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ecc: 2 uncorrected volatile ECC errors (GPU 3" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("UNHEALTHY: ")


def test_dry_run_watch_answers_healthz_and_stops_on_sigterm_as_pid_1(image: Image) -> None:
    unused_port = free_port()
    cmd = image.command(
        [
            "watch",
            "--dry-run",
            "--backend",
            "mock",
            "--interval",
            "0.5",
            "--listen",
            f"127.0.0.1:{unused_port}",
        ],
        env={"NODE_NAME": "image-test-node", "GPUGUARD_LOG_FORMAT": "json"},
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{unused_port}/healthz", timeout=2) as r:
                    status = r.status
                    break
            except OSError:
                time.sleep(0.3)
        assert status == 200, proc.stdout.read() if proc.poll() is not None and proc.stdout else "no answer"
        os.kill(pid1_of(proc.pid), signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        out = proc.stdout.read() if proc.stdout else ""
        assert '"agent.stopping"' in out, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
