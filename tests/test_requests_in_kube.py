"""Every request to the API server is built in `gpuguard/kube/` (kopf's `_cogs/clients/`: only clients talk to
the API). An import contract cannot see strings, so the source outside `kube/` is read: no API path
(a string that starts a path with api/v1 or apis/) and no Event object (a dict with "involvedObject" or
"kind": "Event"); those are `kube/nodes.py`'s, `kube/devicerules.py`'s, `kube/pods.py`'s and
`kube/events.py`'s. Docstrings and comments may name a path."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gpuguard"
# A path of the core API or of an API group, with or without its leading slash (kube.client.path_of's first
# argument has none).
_API_PATH = re.compile(r"(?:^|/)(?:api/v1|apis/)")


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the string constants that are docstrings (a module's, a class's, a function's)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _key(node: ast.expr | None) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def requests_built(source: str) -> Iterator[str]:
    """What in this source builds a request to the API server: each API path literal, each Event body."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if _API_PATH.search(node.value):
                yield f"line {node.lineno}: API path {node.value!r}"
        elif isinstance(node, ast.Dict):
            pairs = {_key(k): v for k, v in zip(node.keys, node.values, strict=True)}
            if "involvedObject" in pairs or _key(pairs.get("kind")) == "Event":
                yield f"line {node.lineno}: an Event body"


def _outside_kube() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "kube" not in p.relative_to(PACKAGE).parts[:1])


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


@pytest.mark.parametrize("path", _outside_kube(), ids=_name)
def test_no_module_outside_kube_builds_a_request_to_the_api_server(path: Path) -> None:
    assert list(requests_built(path.read_text())) == []


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('api.request("GET", "/api/v1/nodes")', True),
        ('f"/apis/resource.k8s.io/{version}/devicetaintrules"', True),
        ('path_of("api/v1/nodes", name)', True),
        ('body = {"apiVersion": "v1", "kind": "Event", "reason": r}', True),
        ('body = {"involvedObject": {"kind": "Node"}}', True),
        ('"""Reads /api/v1/nodes."""\nx = 1', False),
        ('x = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule"}', False),
        ('log.info("node.event_failed", reason="GPUFault")', False),
    ],
)
def test_the_scan_finds_paths_and_event_bodies_and_not_docstrings(source: str, found: bool) -> None:
    assert bool(list(requests_built(source))) is found


def test_the_kube_modules_do_build_the_requests() -> None:
    """The scan is not blind: the request builders it sends everything to are found by it."""
    for name in ("nodes.py", "devicerules.py", "events.py", "pods.py"):
        assert list(requests_built((PACKAGE / "kube" / name).read_text())), name
