"""What gpuguard sends to the API server, checked before it is sent. Pure functions, standard library only.

Two kinds:
- sanitizers, which never fail: `clean_text` makes free text (a fault's reason, an Event or condition
  message) safe to store, with no control or invisible formatting characters and a byte bound;
  `printable` makes a value read from the API safe to print (its unsafe characters escaped);
  `fault_key` does the same for the machine-read fault keys;
- checks, which return their argument or raise ConfigError (one line, the value shown escaped and
  shortened): `node_name`, `label_value`, `taint_value`, `our_key`, and, at the write boundary,
  `check_node_patch` and `check_condition`.

The checks mirror deploy/admission-policy.yaml from the agent's side: a patch that touches anything but
gpuguard's own taints, labels and annotations and the cordon is refused here, before the API server would
refuse it, and the API's own syntax rules (label values, sizes) are enforced with a clear message instead
of a 422. Where the text comes from outside (a GPU's UUID or name, a scenario file, NVML's error strings)
it reaches the node only through these.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from typing import Any

from gpuguard.core.errors import ConfigError

PREFIX = "gpuguard.io/"
MAX_NODE_NAME = 253
MAX_NAME_PART = 63
MAX_LABEL_VALUE = 63
MAX_TEXT_BYTES = 1024
"""One free-text annotation value (the fault's reason): enough for a few faults, short in `kubectl`."""
MAX_ANNOTATION_BYTES = 16 * 1024
"""All gpuguard annotations of one write, keys and values, in UTF-8. The API server allows 256 KiB for all
of a node's annotations together; gpuguard takes a small, fixed share of it."""
MAX_FAULT_KEY_BYTES = 253
"""One fault key: a reason and a GPU UUID (NVML's are 40 characters) with room to spare."""
MAX_EVENT_MESSAGE_BYTES = 1024
"""One Event's message, whatever the faults say: the API server would take 1 MiB, and Events are what
`kubectl describe node` prints."""
MAX_CONDITION_MESSAGE_BYTES = 32 * 1024
"""The API server's own limit for a condition's message."""
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
CONDITION_STATUSES = ("True", "False", "Unknown")

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_NODE_NAME = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_DNS_LABEL_RE = re.compile(_DNS_LABEL)
# The Kubernetes label value syntax (also a taint's value, and the name part of a qualified key).
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_CONDITION_REASON = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?Z")
# Characters that must never reach a node: C0/C1 controls (newlines, escape sequences that repaint a
# terminal running `kubectl describe`), format characters (bidirectional overrides that make text read
# differently than it is stored, zero-width characters), lone surrogates (not encodable as UTF-8) and
# the Unicode line and paragraph separators.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_ELLIPSIS = "..."
_SHOWN = 60


def _unsafe(ch: str) -> bool:
    return unicodedata.category(ch) in _UNSAFE_CATEGORIES


def _show(value: object) -> str:
    """A value for an error message: escaped (one line, whatever it holds) and shortened."""
    if isinstance(value, str) and len(value) > _SHOWN:
        return f"{value[:_SHOWN]!r}... ({len(value)} characters)"
    return repr(value)


# -- sanitizers (never fail) -------------------------------------------------------------------------------


def clean_text(text: str, *, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """`text` safe to store: every run of unsafe characters becomes one space (none next to whitespace),
    the ends are stripped, and the result is at most `max_bytes` of UTF-8, cut at a character boundary
    and marked with "...".

    Idempotent (cleaning a cleaned text changes nothing), so a value read back from the node compares
    equal to the one computed again."""
    if max_bytes < len(_ELLIPSIS) + 1:
        raise ValueError(f"max_bytes must be at least {len(_ELLIPSIS) + 1}")
    out: list[str] = []
    gap = False
    for ch in text:
        if _unsafe(ch):
            gap = True
            continue
        if gap and out and not out[-1].isspace() and not ch.isspace():
            out.append(" ")  # "one\ntwo" stays two words
        gap = False
        out.append(ch)
    cleaned = "".join(out).strip()
    encoded = cleaned.encode("utf-8")
    if len(encoded) <= max_bytes:
        return cleaned
    # errors="ignore" drops a character cut in half; the stripped tail keeps the result idempotent.
    head = encoded[: max_bytes - len(_ELLIPSIS)].decode("utf-8", errors="ignore").rstrip()
    return head + _ELLIPSIS


def printable(text: str) -> str:
    """`text` for a terminal: every unsafe character (an escape sequence's ESC, a bidirectional override, a
    newline) shown as its Python escape (\\x1b, \\u202e, \\n), so what the API holds is visible but does
    nothing. Unlike clean_text it keeps the length and hides nothing: for showing values, not storing them."""
    return "".join(ch.encode("unicode_escape").decode("ascii") if _unsafe(ch) else ch for ch in text)


def fault_key(key: str) -> str:
    """A fault key as recorded in the gpuguard.io/faults annotation ("<reason>/<uuid>", comma-separated):
    every unsafe character, whitespace and ',' (the separator) becomes '_', and it is cut to at most
    MAX_FAULT_KEY_BYTES of UTF-8. Idempotent, so keys computed from a new reading compare equal to the ones
    read back from the node: applied on both sides, a hostile UUID can neither split one key into two nor
    make a recorded fault look new at every check (which would write and raise an Event every interval)."""
    safe = "".join("_" if ch == "," or ch.isspace() or _unsafe(ch) else ch for ch in key)
    encoded = safe.encode("utf-8")
    if len(encoded) <= MAX_FAULT_KEY_BYTES:
        return safe
    return encoded[:MAX_FAULT_KEY_BYTES].decode("utf-8", errors="ignore")


# -- checks (return the value or raise ConfigError) --------------------------------------------------------


def is_dns_label(name: str) -> bool:
    """A DNS-1123 label (a DRA device's name): at most 63 lowercase letters, digits and '-', no dot."""
    return isinstance(name, str) and len(name) <= MAX_NAME_PART and bool(_DNS_LABEL_RE.fullmatch(name))


def node_name(name: str) -> str:
    """A Kubernetes node name: a DNS-1123 subdomain of at most 253 characters."""
    if not isinstance(name, str) or len(name) > MAX_NODE_NAME or not _NODE_NAME.fullmatch(name):
        raise ConfigError(
            f"{_show(name)} is not a valid Kubernetes node name (lower-case letters, digits, '-' and '.', "
            f"starting and ending with a letter or digit, at most {MAX_NODE_NAME} characters)"
        )
    return name


def label_value(value: str, *, what: str = "label value") -> str:
    """A Kubernetes label value: at most 63 characters of [A-Za-z0-9-_.], alphanumeric at both ends, or
    empty."""
    if not isinstance(value, str) or len(value) > MAX_LABEL_VALUE or not _LABEL_VALUE.fullmatch(value):
        raise ConfigError(
            f"{what} {_show(value)} is not valid (at most {MAX_LABEL_VALUE} characters of letters, digits, "
            "'-', '_' and '.', starting and ending with a letter or digit)"
        )
    return value


def taint_value(value: str) -> str:
    """A taint's value has the label value syntax."""
    return label_value(value, what="taint value")


def our_key(key: str) -> str:
    """A label, annotation or taint key of gpuguard's own: "gpuguard.io/" and a valid name part."""
    name = key[len(PREFIX) :] if isinstance(key, str) and key.startswith(PREFIX) else None
    if name is None or len(name) > MAX_NAME_PART or not _NAME_PART.fullmatch(name):
        raise ConfigError(
            f"key {_show(key)} is not gpuguard's: gpuguard writes only keys {PREFIX}<name> "
            f"(name: at most {MAX_NAME_PART} characters of letters, digits, '-', '_' and '.')"
        )
    return key


def taint_key(key: str) -> str:
    """A Kubernetes taint key (a qualified name): [DNS-subdomain prefix "/"] name, the name at most 63
    characters of letters, digits, '-', '_' and '.', starting and ending alphanumeric."""
    prefix, _, name = key.rpartition("/") if isinstance(key, str) else ("", "", "")
    if (
        not name
        or len(name) > MAX_NAME_PART
        or not _NAME_PART.fullmatch(name)
        or (prefix and (len(prefix) > 253 or not _NODE_NAME.fullmatch(prefix)))
        or (not prefix and "/" in key)
    ):
        raise ConfigError(
            f"{_show(key)} is not a taint key: [prefix/]name, the prefix a DNS subdomain, the name at most "
            f"{MAX_NAME_PART} characters of letters, digits, '-', '_' and '.'"
        )
    return key


def _safe_string(value: object, *, where: str, max_bytes: int) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {_show(value)} is not a string")
    bad = next((ch for ch in value if _unsafe(ch)), None)
    if bad is not None:
        raise ConfigError(f"{where}: {_show(value)} holds the control or format character U+{ord(bad):04X}")
    size = len(value.encode("utf-8"))
    if size > max_bytes:
        raise ConfigError(f"{where}: {size} bytes, more than {max_bytes}")
    return value


def check_node_patch(patch: Mapping[str, Any]) -> Mapping[str, Any]:
    """A JSON merge patch for a Node, as gpuguard sends it: returned unchanged, or ConfigError.

    Allowed: metadata.resourceVersion; metadata.annotations and metadata.labels with gpuguard's keys only
    (a value, or None to remove it); spec.unschedulable; spec.taints, the whole list, where gpuguard's own
    taints are checked and every other taint is carried over as the API server gave it (not re-judged:
    what the API accepted once must not stop gpuguard's own write)."""
    _only(_mapping(patch, "patch"), {"metadata", "spec"}, "patch")
    meta = _mapping(patch.get("metadata", {}), "metadata")
    _only(meta, {"resourceVersion", "annotations", "labels"}, "metadata")
    if "resourceVersion" in meta and not isinstance(meta["resourceVersion"], str):
        raise ConfigError(f"metadata.resourceVersion: {_show(meta['resourceVersion'])} is not a string")
    total = 0
    for key, value in _mapping(meta.get("annotations", {}), "metadata.annotations").items():
        our_key(key)
        if value is not None:
            total += len(key.encode("utf-8")) + len(
                _safe_string(value, where=f"annotation {key}", max_bytes=MAX_ANNOTATION_BYTES).encode("utf-8")
            )
    if total > MAX_ANNOTATION_BYTES:
        raise ConfigError(
            f"gpuguard's annotations: {total} bytes in one write, more than {MAX_ANNOTATION_BYTES}"
        )
    for key, value in _mapping(meta.get("labels", {}), "metadata.labels").items():
        our_key(key)
        if value is not None:
            label_value(value, what=f"label {key}:")
    spec = _mapping(patch.get("spec", {}), "spec")
    _only(spec, {"taints", "unschedulable"}, "spec")
    if "unschedulable" in spec and not isinstance(spec["unschedulable"], bool):
        raise ConfigError(f"spec.unschedulable: {_show(spec['unschedulable'])} is not true or false")
    if "taints" in spec:
        taints = spec["taints"]
        if not isinstance(taints, list):
            raise ConfigError("spec.taints: not a list")
        for taint in taints:
            _check_taint(taint)
    return patch


def _check_taint(taint: object) -> None:
    t = _mapping(taint, "spec.taints[]")
    key = t.get("key")
    if not isinstance(key, str):
        raise ConfigError(f"spec.taints[]: key {_show(key)} is not a string")
    if not key.startswith(PREFIX):
        return  # another owner's taint, carried over as read
    our_key(key)
    _only(t, {"key", "value", "effect", "timeAdded"}, f"taint {key}")
    if t.get("effect") not in TAINT_EFFECTS:
        raise ConfigError(
            f"taint {key}: effect {_show(t.get('effect'))} is not one of {', '.join(TAINT_EFFECTS)}"
        )
    if t.get("value") is not None:
        taint_value(t["value"])
    if t.get("timeAdded") is not None and not (
        isinstance(t["timeAdded"], str) and _RFC3339.fullmatch(t["timeAdded"])
    ):
        raise ConfigError(f"taint {key}: timeAdded {_show(t['timeAdded'])} is not an RFC 3339 UTC time")


def check_condition(
    condition: Mapping[str, Any],
    *,
    types: tuple[str, ...] = ("GPUHealthy", "GPUDegraded", "AcceleratedHardwareReady"),
) -> Mapping[str, Any]:
    """A node condition gpuguard writes through nodes/status: returned unchanged, or ConfigError."""
    c = _mapping(condition, "condition")
    _only(c, {"type", "status", "reason", "message", "lastHeartbeatTime", "lastTransitionTime"}, "condition")
    if c.get("type") not in types:
        raise ConfigError(f"condition type {_show(c.get('type'))} is not one of {', '.join(types)}")
    if c.get("status") not in CONDITION_STATUSES:
        raise ConfigError(f"condition status {_show(c.get('status'))} is not True, False or Unknown")
    reason = c.get("reason")
    if reason is not None and not (
        isinstance(reason, str) and len(reason) <= 1024 and _CONDITION_REASON.fullmatch(reason)
    ):
        raise ConfigError(
            f"condition reason {_show(reason)} is not CamelCase letters, digits, '_', ',' or ':'"
        )
    if c.get("message") is not None:
        _safe_string(c["message"], where="condition message", max_bytes=MAX_CONDITION_MESSAGE_BYTES)
    for stamp in ("lastHeartbeatTime", "lastTransitionTime"):
        value = c.get(stamp)
        if value is not None and not (isinstance(value, str) and _RFC3339.fullmatch(value)):
            raise ConfigError(f"condition {stamp} {_show(value)} is not an RFC 3339 UTC time")
    return condition


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{where}: not a mapping with string keys")
    return value


def _only(m: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(m) - allowed)
    if extra:
        raise ConfigError(f"{where}: gpuguard does not write {', '.join(_show(k) for k in extra[:5])}")
