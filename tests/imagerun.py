"""Run the image hack/image/build.sh built the way a kubelet with readOnlyRootFilesystem would, without a
container runtime (none runs on the test machines): the image's root filesystem mounted read-only, in new
mount and PID namespaces (gpuguard is PID 1), as the image's USER, with its ENTRYPOINT, CMD, Env and
WorkingDir, a fresh /proc and a minimal /dev. The network namespace is the host's, so a test reaches
/healthz on 127.0.0.1. Needs root and buildah (the build script installs it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Runs as root inside the new namespaces (host's python, before the chroot), then becomes the image.
_LAUNCHER = r"""
import json, os, subprocess, sys
spec = json.loads(sys.argv[1])
root = spec["root"]
def sh(*a):
    subprocess.run(a, check=True)
sh("mount", "--make-rprivate", "/")
sh("mount", "--bind", root, root)
sh("mount", "-o", "remount,bind,ro", root)
sh("mount", "-t", "proc", "-o", "nosuid,nodev,noexec", "proc", root + "/proc")
sh("mount", "-t", "tmpfs", "-o", "nosuid,mode=755,size=64k", "tmpfs", root + "/dev")
for dev in ("null", "zero", "random", "urandom"):
    open(root + "/dev/" + dev, "w").close()
    sh("mount", "--bind", "/dev/" + dev, root + "/dev/" + dev)
os.chroot(root)
os.chdir(spec["workdir"] or "/")
uid, _, gid = spec["user"].partition(":")
os.setgroups([])
os.setgid(int(gid or uid))
os.setuid(int(uid))
os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
"""


@dataclass(frozen=True)
class Image:
    """A mounted image: its root filesystem and its OCI config (Entrypoint, Cmd, Env, User, ...)."""

    name: str
    rootfs: Path
    config: dict[str, Any]

    @property
    def env(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.config.get("Env") or [])

    def command(
        self,
        args: list[str] | None = None,
        *,
        entrypoint: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> list[str]:
        """The host command line that runs the image: args replace CMD, entrypoint replaces ENTRYPOINT."""
        entry = self.config.get("Entrypoint") or [] if entrypoint is None else entrypoint
        argv = [*entry, *(self.config.get("Cmd") or [] if args is None else args)]
        spec = {
            "root": str(self.rootfs),
            "workdir": self.config.get("WorkingDir") or "/",
            "user": self.config.get("User") or "0",
            "env": self.env | (env or {}),
            "argv": argv,
        }
        return [
            "unshare",
            "--mount",
            "--pid",
            "--fork",
            "--kill-child",
            sys.executable,
            "-c",
            _LAUNCHER,
            json.dumps(spec),
        ]

    def run(self, args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        entrypoint = kw.pop("entrypoint", None)
        env = kw.pop("env", None)
        return subprocess.run(
            self.command(args, entrypoint=entrypoint, env=env),
            capture_output=True,
            text=True,
            check=False,
            **kw,
        )


def _buildah(*args: str) -> str:
    return subprocess.run(["buildah", *args], capture_output=True, text=True, check=True).stdout.strip()


@contextmanager
def mounted(name: str) -> Iterator[Image]:
    """A working container of the image, its root filesystem mounted; removed again afterwards."""
    config = json.loads(_buildah("inspect", "--type", "image", name))["OCIv1"]["config"]
    ctr = _buildah("from", "--pull=never", name)
    try:
        yield Image(name=name, rootfs=Path(_buildah("mount", ctr)), config=config)
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True, check=False)


def pid1_of(unshare_pid: int) -> int:
    """The image's PID 1 (the child unshare forked), seen from the host."""
    children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
    if not children:
        raise RuntimeError(f"unshare {unshare_pid} has no child")
    return int(children[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_root() -> bool:
    return os.geteuid() == 0
