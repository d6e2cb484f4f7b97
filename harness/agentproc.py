"""`gpuguard watch` as a subprocess: the one harness the CLI, nvml-backend and cluster tests and the
benchmarks share. It scrubs the environment (no GPUGUARD_*, KUBERNETES_*, KUBECONFIG, NODE_NAME or proxy
variable of the caller leaks in), reads the JSON log lines on a thread, takes the port from
`server.listening` (port 0 lets the OS choose one) and polls /healthz and /readyz."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_SCRUBBED = ("GPUGUARD_", "KUBERNETES_")
_SCRUBBED_NAMES = {"KUBECONFIG", "NODE_NAME", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"}
_SCRUBBED_NAMES |= {"NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"}


def scrubbed_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without anything that configures gpuguard, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED) and k not in _SCRUBBED_NAMES}
    return {**env, **(extra or {})}


def gpuguard_command() -> list[str]:
    """`gpuguard` exactly as the image runs it (the console script), from this interpreter's venv."""
    script = Path(sys.executable).parent / "gpuguard"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpuguard"]


class WatchProcess:
    """`gpuguard watch ARGS --listen 127.0.0.1:0 --log-format json` with a scrubbed environment plus `env`.

    `lines`: the decoded log lines (a line that is not JSON is kept as {"event": "non-json"}), at most
    `max_lines`. `port`: the HTTP port once `server.listening` was logged."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        command: Sequence[str] | None = None,
        max_lines: int = 100_000,
    ) -> None:
        self.args = args
        # No start-up jitter unless a test asks for it: the tests time an agent's first writes (the gate,
        # the condition), and a lone agent is no herd (tests/test_api_load.py tests the jitter itself).
        self.env = {"GPUGUARD_STARTUP_JITTER": "0", **(env or {})}
        self.command = list(command) if command is not None else [sys.executable, "-m", "gpuguard"]
        self.max_lines = max_lines
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.lines: list[dict[str, Any]] = []
        self.t_start = 0.0
        self.t_listening = 0.0
        self._listening = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self) -> WatchProcess:
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(
            [*self.command, "watch", *self.args, "--listen", "127.0.0.1:0", "--log-format", "json"],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=scrubbed_env(self.env),
            cwd=ROOT,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                doc = {"event": "non-json", "line": line.rstrip()}
            if len(self.lines) < self.max_lines:
                self.lines.append(doc)
            if doc.get("event") == "server.listening":
                self.port = int(doc["port"])
                self.t_listening = time.monotonic()
                self._listening.set()
        self._listening.set()  # exited: nobody waits for a port that never comes

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_listening(self, timeout: float = 20.0) -> int:
        """The port, once the server listens; AssertionError (with the log) if the agent exits first."""
        if not self._listening.wait(timeout) or not self.port:
            raise AssertionError(f"the agent never listened: {self.lines[-10:]}")
        return self.port

    def wait_ready(self, timeout: float = 60.0, poll: float = 0.002) -> float:
        """The monotonic instant /readyz first answered 200."""
        deadline = time.monotonic() + timeout
        self.wait_listening(timeout)
        while not self.ready():
            self._check_alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"the agent was not ready after {timeout}s: {self.lines[-10:]}")
            time.sleep(poll)
        return time.monotonic()

    def wait_first_check(self, timeout: float = 60.0, poll: float = 0.002) -> float:
        """The monotonic instant of the agent's first complete check, as /healthz reports its time
        (`last_check`, wall clock), polled from when the agent listens (before its loop starts)."""
        deadline = time.monotonic() + timeout
        self.wait_listening(timeout)
        while True:
            try:
                stamp = self.healthz()[1].get("last_check")
            except (urllib.error.URLError, OSError, ValueError):
                stamp = None
            if stamp:
                wall = datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
                return time.monotonic() - (time.time() - wall)
            self._check_alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"no check after {timeout}s: {self.lines[-10:]}")
            time.sleep(poll)

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the agent exited {self.proc.returncode}: {self.lines[-10:]}")

    def healthz(self) -> tuple[int, dict[str, Any]]:
        return healthz_status(self.port)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line.get("event") == name]

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def wait(self, timeout: float = 30.0) -> int:
        """Wait for the agent to exit by itself (--run-for); the exit code, with every log line read."""
        assert self.proc is not None
        self.proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(5)
        return int(self.proc.returncode)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait (SIGKILL after `timeout`); the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._reader is not None:
            self._reader.join(5)
        return int(self.proc.returncode)

    def tracebacks(self) -> list[dict[str, Any]]:
        return [line for line in self.lines if "Traceback" in json.dumps(line)]


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
