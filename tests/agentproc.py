"""`gpuguard watch` as a subprocess, and its /healthz: shared by the CLI, nvml-backend and cluster tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def spawn_watch(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """`gpuguard watch ARGS --listen 127.0.0.1:0 --log-format json`, stderr piped (JSON log lines)."""
    return subprocess.Popen(
        [sys.executable, "-m", "gpuguard", "watch", *args, "--listen", "127.0.0.1:0", "--log-format", "json"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
    )


def read_port(p: subprocess.Popen[str], lines: list[str] | None = None) -> int:
    """Read log lines until `server.listening` and return its port (port 0 lets the OS choose one)."""
    assert p.stderr is not None
    seen = lines if lines is not None else []
    while True:
        line = p.stderr.readline()
        if not line:
            raise AssertionError("the agent exited before listening: " + "".join(seen))
        seen.append(line)
        doc = json.loads(line)
        if doc.get("event") == "server.listening":
            return int(doc["port"])


def healthz(port: int) -> dict[str, Any]:
    """The /healthz body, whether the status is 200 or 503."""
    return healthz_status(port)[1]


def healthz_status(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_until(
    port: int, pred: Callable[[dict[str, Any]], bool], timeout: float
) -> tuple[dict[str, Any], float]:
    """Poll /healthz until pred holds or the timeout passes; the last body and the seconds it took."""
    start = time.monotonic()
    while True:
        doc = healthz(port)
        if pred(doc) or time.monotonic() - start > timeout:
            return doc, time.monotonic() - start
        time.sleep(0.005)
