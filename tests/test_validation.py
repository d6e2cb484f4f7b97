"""gpuguard.core.validation: the syntax rules checked against independent reference implementations (written
from the Kubernetes definitions, not from the module), the sanitizers' guarantees as properties, and the
write-boundary checks against every patch and condition that gpuguard's own planner produces."""

from __future__ import annotations

import string
import unicodedata
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuguard.core import validation as v
from gpuguard.core.config import NodeSettings, PolicySettings
from gpuguard.core.errors import ConfigError
from gpuguard.core.model import GpuReading, Snapshot, XidEvent, recovery_reason
from gpuguard.judge.policy import evaluate
from gpuguard.quarantine.budget import Budget
from gpuguard.quarantine.node.budget import limit
from gpuguard.quarantine.node.plan import plan, plan_condition
from gpuguard.quarantine.node.view import (
    LABEL_QUARANTINED,
    UNVERIFIED_TAINT_KEY,
    NodeView,
    Taint,
    apply_change,
)
from gpuguard.quarantine.record import ANN_FAULTS, TAINT_KEY

FAST = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
ALNUM = set(string.ascii_letters + string.digits)
NOW = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)


def rejects(fn: Any, value: Any) -> str:
    """The ConfigError message for `value`; it must be one line."""
    with pytest.raises(ConfigError) as err:
        fn(value)
    message = str(err.value)
    assert "\n" not in message and "\r" not in message, message
    assert len(message) < 400, message
    return message


# Reference implementations, from the Kubernetes API conventions (IsDNS1123Subdomain, IsValidLabelValue,
# IsQualifiedName), written without regular expressions so that they share no mistake with the module.


def ref_dns_label(s: str) -> bool:
    lower = set(string.ascii_lowercase + string.digits)
    # No per-label length limit: IsDNS1123Subdomain bounds only the whole name.
    return len(s) >= 1 and s[0] in lower and s[-1] in lower and set(s) <= lower | {"-"}


def ref_node_name(s: str) -> bool:
    return 1 <= len(s) <= 253 and all(ref_dns_label(part) for part in s.split("."))


def ref_label_value(s: str) -> bool:
    if s == "":
        return True
    return len(s) <= 63 and s[0] in ALNUM and s[-1] in ALNUM and set(s) <= ALNUM | set("-_.")


def ref_our_key(s: str) -> bool:
    prefix, sep, name = s.partition("/")
    return prefix == "gpuguard.io" and sep == "/" and name != "" and "/" not in name and ref_label_value(name)


NAMEISH = st.text(alphabet=string.ascii_lowercase + string.digits + "-.", max_size=260)
VALUEISH = st.text(alphabet=string.ascii_letters + string.digits + "-_./ ", max_size=70)
ANY_TEXT = st.text(max_size=300)


# -- node names ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "a",
        "gpu-1",
        "ip-10-0-0-1.ec2.internal",
        "0",
        "a" * 64 + "." + "b" * 63,
        "a" * 253,
        ("a" * 63 + ".") * 3 + "a",
    ],
)
def test_valid_node_names_are_accepted(name: str) -> None:
    assert v.node_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "A", "Gpu-1", "-a", "a-", "a..b", "a.-b", "a-.b", ".a", "a.", "a_b", "a b", "a\n", "ä", "a" * 254,
     ("a" * 63 + ".") * 4 + "a", "gpu-1\x00"],
)  # fmt: skip
def test_invalid_node_names_are_refused_with_one_line(name: str) -> None:
    assert "not a valid Kubernetes node name" in rejects(v.node_name, name)


@FAST
@given(st.one_of(NAMEISH, ANY_TEXT))
def test_node_names_are_accepted_exactly_when_the_reference_accepts_them(name: str) -> None:
    if ref_node_name(name):
        assert v.node_name(name) == name
    else:
        rejects(v.node_name, name)


def test_a_node_name_that_is_not_a_string_is_refused() -> None:
    rejects(v.node_name, None)
    rejects(v.node_name, b"gpu-1")


# -- label and taint values ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["", "a", "true", "deferred", "xid-79", "nvml-init", "A.b_c-9", "x" * 63])
def test_valid_label_and_taint_values_are_accepted(value: str) -> None:
    assert v.label_value(value) == value
    assert v.taint_value(value) == value


@pytest.mark.parametrize(
    "value", ["-a", "a-", "_a", ".", "a b", "a/b", "ä", "a\n", "x" * 64, "a:b", "xid 79"]
)
def test_invalid_label_and_taint_values_are_refused_and_say_which(value: str) -> None:
    assert rejects(v.label_value, value).startswith("label value ")
    assert rejects(v.taint_value, value).startswith("taint value ")


@FAST
@given(st.one_of(VALUEISH, ANY_TEXT))
def test_label_values_are_accepted_exactly_when_the_reference_accepts_them(value: str) -> None:
    if ref_label_value(value):
        assert v.label_value(value) == value
    else:
        rejects(v.label_value, value)


def test_every_reason_gpuguard_uses_as_a_taint_value_is_valid() -> None:
    from gpuguard.core.model import ECC, GPU_LOST, GPU_MISSING, NVML_INIT, ROW_REMAP, xid_reason

    for reason in (ECC, GPU_LOST, GPU_MISSING, NVML_INIT, ROW_REMAP, xid_reason(0), xid_reason(2**32 - 1)):
        v.taint_value(reason)


# -- keys ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", [TAINT_KEY, UNVERIFIED_TAINT_KEY, LABEL_QUARANTINED, ANN_FAULTS, "gpuguard.io/" + "a" * 63]
)
def test_gpuguards_own_keys_are_accepted(key: str) -> None:
    assert v.our_key(key) == key


@pytest.mark.parametrize(
    "key",
    ["gpuguard.io/", "gpuguard.io", "example.com/x", "team", "gpuguard.io/a/b", "gpuguard.io.evil/x",
     "evil.gpuguard.io/x", "GPUGUARD.IO/x", "gpuguard.io/-x", "gpuguard.io/" + "a" * 64, "gpuguard.io/a b"],
)  # fmt: skip
def test_keys_that_are_not_gpuguards_are_refused(key: str) -> None:
    assert "is not gpuguard's" in rejects(v.our_key, key)


@FAST
@given(st.one_of(st.builds(lambda s: "gpuguard.io/" + s, VALUEISH), VALUEISH, ANY_TEXT))
def test_our_keys_are_accepted_exactly_when_the_reference_accepts_them(key: str) -> None:
    if ref_our_key(key):
        assert v.our_key(key) == key
    else:
        rejects(v.our_key, key)


# -- free text -----------------------------------------------------------------------------------------------


def _unsafe(ch: str) -> bool:
    return unicodedata.category(ch) in {"Cc", "Cf", "Cs", "Zl", "Zp"}


@pytest.mark.parametrize(
    ("text", "cleaned"),
    [
        ("ecc: 3 uncorrected volatile ECC errors (GPU 1, GPU-bbbb)", None),
        ("line one\nline two\r\n\tthree", "line one line two three"),
        ("\x1b[2J\x1b[31mred", "[2J [31mred"),  # a terminal escape cannot repaint `kubectl describe`
        ("GPU-\u202egnp.exe", "GPU- gnp.exe"),  # a bidirectional override cannot reorder what is shown
        ("zero\u200bwidth\ufeff", "zero width"),
        ("sep\u2028ara\u2029ted", "sep ara ted"),
        ("  padded  ", "padded"),
        ("\x00\x01\x02", ""),
        ("lone \ud800 surrogate", "lone  surrogate"),
    ],
)
def test_clean_text_removes_control_and_invisible_characters(text: str, cleaned: str | None) -> None:
    assert v.clean_text(text) == (text if cleaned is None else cleaned)


def test_clean_text_cuts_at_a_character_boundary_and_marks_the_cut() -> None:
    assert v.clean_text("é" * 600, max_bytes=10) == "ééé..."  # 6 bytes of é, 3 of "...", never half an é
    assert v.clean_text("🙂" * 10, max_bytes=9) == "🙂..."
    assert v.clean_text("🙂" * 10, max_bytes=4) == "..."
    assert v.clean_text("word " * 300, max_bytes=20) == "word word word wo..."
    assert v.clean_text("a" * 1024) == "a" * 1024
    assert v.clean_text("a" * 1025) == "a" * 1021 + "..."


def test_clean_text_refuses_a_bound_too_small_to_mark_a_cut() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        v.clean_text("text", max_bytes=3)


@settings(max_examples=500, deadline=None, database=None)
@given(ANY_TEXT, st.integers(min_value=4, max_value=400))
def test_clean_text_is_bounded_safe_and_idempotent(text: str, max_bytes: int) -> None:
    out = v.clean_text(text, max_bytes=max_bytes)
    assert len(out.encode("utf-8")) <= max_bytes
    assert not any(_unsafe(ch) for ch in out)
    assert out == out.strip()
    assert v.clean_text(out, max_bytes=max_bytes) == out
    if not out.endswith("..."):
        # Nothing was cut: every safe character is still there, in order.
        assert out.replace(" ", "") == "".join(ch for ch in text if not _unsafe(ch)).replace(" ", "").strip()


@settings(max_examples=500, deadline=None, database=None)
@given(ANY_TEXT)
def test_fault_keys_are_printable_have_no_separator_and_are_idempotent(key: str) -> None:
    out = v.fault_key(key)
    assert "," not in out and not any(ch.isspace() or _unsafe(ch) for ch in out)
    assert len(out.encode("utf-8")) <= v.MAX_FAULT_KEY_BYTES
    assert v.fault_key(out) == out


def test_fault_keys_from_nvml_are_unchanged() -> None:
    for key in ("ecc/GPU-2a9e4b7c-5d1f-4c3e-9a8b-0123456789ab", "nvml-init/node", "xid-79/GPU-0"):
        assert v.fault_key(key) == key
    assert v.fault_key("ecc/GPU-a,xid-79/GPU-b") == "ecc/GPU-a_xid-79/GPU-b"


# -- the node patch ------------------------------------------------------------------------------------------

OURS = {"key": TAINT_KEY, "value": "ecc", "effect": "NoSchedule"}
FOREIGN = {"key": "Example.COM/odd key", "value": "anything at all, even ä", "effect": "Whatever"}


def patch(**parts: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"resourceVersion": "10", **parts.pop("metadata", {})}}
    if parts:
        body["spec"] = parts
    return body


@pytest.mark.parametrize(
    "body",
    [
        patch(),
        patch(
            taints=[FOREIGN, OURS], unschedulable=True, metadata={"annotations": {ANN_FAULTS: "ecc/GPU-0"}}
        ),
        patch(taints=[], unschedulable=False),
        patch(taints=[{**OURS, "timeAdded": "2026-12-02T12:00:00Z"}]),
        patch(metadata={"annotations": {ANN_FAULTS: None}, "labels": {LABEL_QUARANTINED: None}}),
        patch(metadata={"labels": {LABEL_QUARANTINED: "deferred"}}),
        patch(metadata={"annotations": {"gpuguard.io/reason": "x" * (v.MAX_ANNOTATION_BYTES - 18)}}),
    ],
)
def test_patches_of_gpuguards_own_fields_pass(body: dict[str, Any]) -> None:
    assert v.check_node_patch(body) is body


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (patch(metadata={"annotations": {"owner": "x"}}), "'owner' is not gpuguard's"),
        (patch(metadata={"labels": {"team": "x"}}), "'team' is not gpuguard's"),
        (patch(metadata={"labels": {LABEL_QUARANTINED: "not valid!"}}), "label gpuguard.io/quarantined:"),
        (patch(metadata={"finalizers": ["x"]}), "does not write 'finalizers'"),
        (patch(metadata={"resourceVersion": 10}), "resourceVersion"),
        (patch(podCIDR="10.0.0.0/24"), "does not write 'podCIDR'"),
        ({"status": {}}, "does not write 'status'"),
        (patch(unschedulable="true"), "not true or false"),
        (patch(taints={"key": TAINT_KEY}), "not a list"),
        (patch(taints=["x"]), "not a mapping"),
        (patch(taints=[{"value": "x"}]), "key None is not a string"),
        (patch(taints=[{**OURS, "value": "xid 79"}]), "taint value 'xid 79'"),
        (patch(taints=[{**OURS, "effect": "Evict"}]), "effect 'Evict'"),
        (patch(taints=[{**OURS, "timeAdded": "yesterday"}]), "timeAdded"),
        (patch(taints=[{**OURS, "tolerationSeconds": 1}]), "does not write 'tolerationSeconds'"),
        (patch(taints=[{**OURS, "key": "gpuguard.io/"}]), "is not gpuguard's"),
        (
            patch(metadata={"annotations": {"gpuguard.io/reason": "a\nb"}}),
            "control or format character U+000A",
        ),
        (patch(metadata={"annotations": {"gpuguard.io/reason": "a\u202eb"}}), "U+202E"),
        (patch(metadata={"annotations": {"gpuguard.io/reason": 3}}), "is not a string"),
        (
            patch(metadata={"annotations": {"gpuguard.io/reason": "x" * (v.MAX_ANNOTATION_BYTES + 1)}}),
            "bytes",
        ),
        (
            patch(metadata={"annotations": {f"gpuguard.io/a{i}": "x" * 2000 for i in range(9)}}),
            "more than 16384",
        ),
        ({"metadata": ["x"]}, "not a mapping"),
        ({"metadata": {1: "x"}}, "not a mapping"),
    ],
)
def test_patches_that_reach_beyond_gpuguards_fields_are_refused_locally(body: Any, says: str) -> None:
    assert says in rejects(v.check_node_patch, body)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


@FAST
@given(JSONISH)
def test_the_patch_check_raises_only_config_error_on_any_input(body: Any) -> None:
    try:
        v.check_node_patch(body)
    except ConfigError as exc:
        assert "\n" not in str(exc)


# Every patch gpuguard's planner produces must pass the check: a planner output the check refused would
# never reach the node. Snapshots and node states are generated; UUIDs are NVML-like (printable ASCII).
UUIDS = st.from_regex(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", fullmatch=True)


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    uuids = draw(st.lists(UUIDS, min_size=0, max_size=8, unique=True))
    gpus = tuple(
        GpuReading(
            index=i,
            uuid=u,
            ecc_uncorrected=draw(st.sampled_from([0, 0, 1, 7, None])),
            lost=draw(st.booleans()) and draw(st.booleans()),
            remap_failure=draw(st.sampled_from([None, False, True])),
        )
        for i, u in enumerate(uuids)
    )
    xids = tuple(
        XidEvent(gpu_index=g.index, uuid=g.uuid, code=draw(st.sampled_from([13, 31, 48, 79, 94, 109])))
        for g in gpus
        if draw(st.booleans()) and draw(st.booleans())
    )
    init_error = draw(st.sampled_from([None, None, None, "DRIVER_NOT_LOADED"]))
    return Snapshot(gpus=() if init_error else gpus, xids=() if init_error else xids, init_error=init_error)


@st.composite
def nodes(draw: st.DrawFn) -> NodeView:
    taints = []
    if draw(st.booleans()):
        taints.append(Taint(key="example.com/maintenance", value="x", effect="NoExecute"))
    if draw(st.booleans()):
        taints.append(Taint(key=UNVERIFIED_TAINT_KEY, effect="NoSchedule"))
    return NodeView(
        name="gpu-1",
        resource_version="7",
        boot_id=draw(st.sampled_from(["boot-a", "boot-b"])),
        taints=tuple(taints),
        unschedulable=draw(st.booleans()),
        labels={"team": "ml"},
    )


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes(), st.lists(snapshots(), min_size=1, max_size=5), st.booleans(), st.integers(0, 3))
def test_every_patch_and_condition_the_planner_produces_passes_the_checks(
    node: NodeView, sequence: list[Snapshot], full_budget: bool, quarantined: int
) -> None:
    node_settings = NodeSettings(name="gpu-1", recover_after=1)
    budget = Budget(gpu_nodes=10, quarantined=quarantined, limit=10 if full_budget else quarantined)
    previous = None
    for snapshot in sequence:
        verdict = evaluate(snapshot, previous=previous, settings=PolicySettings())
        previous = verdict
        change = limit(
            plan(node, verdict, healthy_streak=5, settings=node_settings, now=NOW),
            node,
            verdict,
            budget,
            node_settings,
        )
        if change is not None:
            v.check_node_patch(change.patch(node.resource_version))
            node = apply_change(node, change)
        condition = plan_condition(node.gpu_condition, verdict, last_keys=None, now=NOW)
        if condition is not None:
            v.check_condition(condition)


# -- the GPUHealthy condition --------------------------------------------------------------------------------

GOOD_CONDITION = {
    "type": "GPUHealthy",
    "status": "False",
    "reason": "GPUFault",
    "message": "ecc: 3 uncorrected volatile ECC errors (GPU 1, GPU-bbbb)",
    "lastHeartbeatTime": "2026-12-02T12:00:00Z",
    "lastTransitionTime": "2026-12-02T12:00:00.123456Z",
}


def test_a_gpu_healthy_condition_passes() -> None:
    assert v.check_condition(GOOD_CONDITION) is GOOD_CONDITION


@pytest.mark.parametrize("kind", ["GPUDegraded", "AcceleratedHardwareReady"])
def test_the_degraded_and_the_accelerated_hardware_conditions_pass_too(kind: str) -> None:
    condition = {**GOOD_CONDITION, "type": kind}
    assert v.check_condition(condition) is condition


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"type": "Ready"}, "condition type 'Ready'"),
        ({"status": "false"}, "condition status"),
        ({"reason": "GPU fault"}, "condition reason"),
        ({"reason": "9Lives"}, "condition reason"),
        ({"message": "a\x1b[2Jb"}, "U+001B"),
        ({"message": "x" * (v.MAX_CONDITION_MESSAGE_BYTES + 1)}, "bytes"),
        ({"lastHeartbeatTime": "now"}, "lastHeartbeatTime"),
        ({"lastTransitionTime": "2026-12-02 12:00:00"}, "lastTransitionTime"),
        ({"observedGeneration": 1}, "does not write 'observedGeneration'"),
    ],
)
def test_a_condition_gpuguard_does_not_write_is_refused(change: dict[str, Any], says: str) -> None:
    assert says in rejects(v.check_condition, {**GOOD_CONDITION, **change})


@settings(max_examples=300, deadline=None, database=None)
@given(ANY_TEXT, st.lists(ANY_TEXT, max_size=20), st.text(max_size=70))
def test_whatever_the_input_the_sanitized_values_pass_the_patch_check(
    reason: str, keys: list[str], quarantined: str
) -> None:
    """Hostile text (a GPU UUID or name from a scenario file, an NVML error string) made safe by the
    sanitizers always passes the check: clean_text and fault_key are what node.py runs such text through."""
    body = patch(
        taints=[{**OURS, "value": "xid-79"}],
        metadata={
            "annotations": {
                "gpuguard.io/reason": v.clean_text(reason),
                ANN_FAULTS: ",".join(v.fault_key(k) for k in keys),
            },
            "labels": {LABEL_QUARANTINED: quarantined if ref_label_value(quarantined) else "true"},
        },
    )
    assert v.check_node_patch(body) is body


@pytest.mark.parametrize(
    "key",
    [
        "gpuguard.io/unverified",
        "startup-taint.cluster-autoscaler.kubernetes.io/gpuguard",
        "readiness.k8s.io/gpu-healthy",
        "example.com/GPU_unverified.v1",
        "unprefixed",
    ],
)
def test_taint_keys_the_gate_may_use_are_accepted(key: str) -> None:
    from gpuguard.core.validation import taint_key

    assert taint_key(key) == key


@pytest.mark.parametrize(
    "key", ["", "/name", "example.com/", "Example.COM/x", "a/b/c", "x" * 64, "example.com/-x", "a b"]
)
def test_malformed_taint_keys_are_refused(key: str) -> None:
    from gpuguard.core.validation import taint_key

    with pytest.raises(ConfigError, match="is not a taint key"):
        taint_key(key)


# -- gpuguard's own taints at the write boundary, and exact bounds -------------------------------------------


@pytest.mark.parametrize("effect", ["NoSchedule", "PreferNoSchedule", "NoExecute"])
def test_gpuguards_own_taint_passes_the_write_boundary_with_every_effect_it_may_be_set_to(
    effect: str,
) -> None:
    body = patch(taints=[FOREIGN, {"key": TAINT_KEY, "value": "xid-79", "effect": effect}])
    assert v.check_node_patch(body) is body
    planned = plan(
        NodeView(name="gpu-1", resource_version="1", boot_id="b"),
        evaluate(
            Snapshot(gpus=(GpuReading(0, "GPU-0", ecc_uncorrected=1),)),
            previous=None,
            settings=PolicySettings(),
        ),
        healthy_streak=0,
        settings=NodeSettings(name="gpu-1", taint_effect=effect),
        now=NOW,
    )
    assert planned is not None
    assert v.check_node_patch(planned.patch("1"))["spec"]["taints"] == [{"key": TAINT_KEY, "effect": effect}]


@pytest.mark.parametrize(
    ("action", "value"),
    [
        (0, "recovery-none"),
        (1, "recovery-gpu-reset"),
        (2, "recovery-node-reboot"),
        (3, "recovery-drain-p2p"),
        (4, "recovery-drain-and-reset"),
        (5, "recovery-recover-imex-domain"),
        (6, "recovery-bus-reset"),
        (7, "recovery-system-reboot"),
        (8, "recovery-8"),
    ],
)
def test_every_recovery_action_name_is_a_valid_label_value_recorded_on_the_node(
    action: int, value: str
) -> None:
    assert recovery_reason(action) == value and v.taint_value(value) == value
    if action == 0:
        return  # NONE is no fault
    sick = evaluate(
        Snapshot(gpus=(GpuReading(0, "GPU-0", recovery_action=action),)),
        previous=None,
        settings=PolicySettings(),
    )
    planned = plan(
        NodeView(name="gpu-1", resource_version="1", boot_id="b"),
        sick,
        healthy_streak=0,
        settings=NodeSettings(name="gpu-1"),
        now=NOW,
    )
    assert planned is not None
    patch = v.check_node_patch(planned.patch("1"))
    assert patch["spec"]["taints"] == [{"key": TAINT_KEY, "effect": "NoSchedule"}]
    assert patch["metadata"]["annotations"]["gpuguard.io/faults"] == f"{value}/GPU-0"


def test_a_fault_key_of_253_bytes_is_kept_and_a_longer_one_cut_at_a_character_boundary() -> None:
    exact = "x" * 253
    assert v.fault_key(exact) == exact
    assert v.fault_key(exact + "y") == exact
    assert v.fault_key("x" * 252 + "é") == "x" * 252  # é is two bytes: cut whole


@pytest.mark.parametrize(("length", "valid"), [(253, True), (254, False)])
def test_a_node_name_of_253_characters_is_the_longest_accepted(length: int, valid: bool) -> None:
    name = ".".join(["a" * 63] * 4)[:length].rstrip(".")
    name = name + "b" * (length - len(name))
    assert len(name) == length
    if valid:
        assert v.node_name(name) == name
    else:
        assert "at most 253" in rejects(v.node_name, name)


@pytest.mark.parametrize(("length", "valid"), [(63, True), (64, False)])
def test_a_label_value_and_a_key_name_of_63_characters_is_the_longest_accepted(
    length: int, valid: bool
) -> None:
    value, key = "a" * length, "gpuguard.io/" + "a" * length
    if valid:
        assert v.label_value(value) == value and v.our_key(key) == key and v.taint_key(key) == key
    else:
        assert "at most 63" in rejects(v.label_value, value)
        assert "at most 63" in rejects(v.our_key, key)
        assert "at most 63" in rejects(v.taint_key, key)


@pytest.mark.parametrize(("length", "valid"), [(253, True), (254, False)])
def test_a_taint_key_prefix_of_253_characters_is_the_longest_accepted(length: int, valid: bool) -> None:
    key = "a" * length + "/gate"
    if valid:
        assert v.taint_key(key) == key
    else:
        rejects(v.taint_key, key)


def test_clean_text_keeps_1024_bytes_and_cuts_one_more_to_1024_with_the_mark() -> None:
    assert v.clean_text("x" * 1024) == "x" * 1024
    assert v.clean_text("x" * 1025) == "x" * 1021 + "..."
    assert v.clean_text("xy", max_bytes=4) == "xy" and v.clean_text("xyzzy", max_bytes=4) == "x..."
    with pytest.raises(ValueError, match="at least 4"):
        v.clean_text("x", max_bytes=3)


@pytest.mark.parametrize(
    ("text", "cleaned"),
    [
        ("a\nb", "a b"),
        ("a \nb", "a b"),
        ("a\n b", "a b"),
        ("\x1ba", "a"),
        ("a\x1b", "a"),
        ("a\x00\x01b", "a b"),
    ],
)
def test_clean_text_makes_one_space_of_a_run_of_unsafe_characters_and_none_beside_a_space(
    text: str, cleaned: str
) -> None:
    assert v.clean_text(text) == cleaned


def test_printable_escapes_unsafe_characters_and_keeps_the_rest() -> None:
    assert v.printable("a\x1b[31mé\u202e\n") == "a\\x1b[31mé\\u202e\\n"


@pytest.mark.parametrize(
    ("total", "valid"),
    [(v.MAX_ANNOTATION_BYTES, True), (v.MAX_ANNOTATION_BYTES + 1, False)],
)
def test_the_annotations_of_one_write_may_hold_16_kib_keys_included(total: int, valid: bool) -> None:
    keys = [f"gpuguard.io/a{i}" for i in range(9)]
    per = (total - sum(len(k) for k in keys)) // 9
    values = {k: "x" * per for k in keys}
    rest = total - sum(len(k) + per for k in keys)
    values[keys[0]] += "x" * rest
    body = patch(metadata={"annotations": values})
    if valid:
        assert v.check_node_patch(body) is body
    else:
        assert "more than 16384" in rejects(v.check_node_patch, body)


@pytest.mark.parametrize(
    ("condition", "valid"),
    [
        ({"type": "GPUHealthy", "status": "True", "reason": "R" * 1024}, True),
        ({"type": "GPUHealthy", "status": "True", "reason": "R" * 1025}, False),
        ({"type": "GPUHealthy", "status": "Unknown", "lastHeartbeatTime": "2026-12-02T12:00:00.5Z"}, True),
        ({"type": "GPUHealthy", "status": "True", "lastTransitionTime": "2026-12-02 12:00:00"}, False),
        ({"type": "GPUHealthy", "status": "True", "message": "m" * v.MAX_CONDITION_MESSAGE_BYTES}, True),
        (
            {"type": "GPUHealthy", "status": "True", "message": "m" * (v.MAX_CONDITION_MESSAGE_BYTES + 1)},
            False,
        ),
        ({"type": "GPUHealthy", "status": "True", "reason": "GPU,Fault:1"}, True),
        ({"type": "GPUHealthy", "status": "True", "reason": "1GPU"}, False),
    ],
)
def test_a_conditions_reason_message_and_times_are_bounded_and_well_formed(
    condition: dict[str, Any], valid: bool
) -> None:
    if valid:
        assert v.check_condition(condition) is condition
    else:
        rejects(v.check_condition, condition)


@pytest.mark.parametrize(
    ("check", "body", "says"),
    [
        (v.check_node_patch, [], "patch: not a mapping with string keys"),
        (v.check_node_patch, {"status": {}}, "patch: gpuguard does not write 'status'"),
        (v.check_node_patch, {"metadata": []}, "metadata: not a mapping with string keys"),
        (v.check_node_patch, {"metadata": {"uid": "u"}}, "metadata: gpuguard does not write 'uid'"),
        (
            v.check_node_patch,
            {"metadata": {"annotations": []}},
            "metadata.annotations: not a mapping with string keys",
        ),
        (v.check_node_patch, {"metadata": {"labels": []}}, "metadata.labels: not a mapping with string keys"),
        (v.check_node_patch, {"spec": []}, "spec: not a mapping with string keys"),
        (v.check_node_patch, {"spec": {"podCIDR": "x"}}, "spec: gpuguard does not write 'podCIDR'"),
        (v.check_node_patch, {"spec": {"taints": [[]]}}, "spec.taints[]: not a mapping with string keys"),
        (v.check_condition, [], "condition: not a mapping with string keys"),
        (
            v.check_condition,
            {"type": "GPUHealthy", "status": "True", "x": 1},
            "condition: gpuguard does not write 'x'",
        ),
        (
            v.check_condition,
            {"type": "GPUHealthy", "status": "True", "message": "a\nb"},
            "condition message: 'a\\nb' holds the control or format character U+000A",
        ),
    ],
)
def test_a_refused_write_names_the_field_it_refuses(check: Any, body: Any, says: str) -> None:
    assert rejects(check, body) == says


@pytest.mark.parametrize(("length", "shown"), [(60, None), (61, "... (61 characters)")])
def test_a_long_value_in_an_error_is_shown_cut_to_60_characters(length: int, shown: str | None) -> None:
    value = "A" * length
    message = rejects(v.node_name, value)
    if shown is None:
        assert repr(value) in message and "... (60 characters)" not in message
    else:
        assert f"{'A' * 60!r}{shown}" in message and repr(value) not in message


@pytest.mark.parametrize("key", [None, 5, ["gpuguard.io/x"]])
def test_a_taint_key_that_is_not_a_string_is_refused(key: Any) -> None:
    rejects(v.taint_key, key)


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("gpu-0", True),
        ("a" * 63, True),  # the most a label may hold
        ("a" * 64, False),
        ("", False),
        ("GPU-0", False),
        ("gpu.0", False),
        ("-gpu", False),
        ("gpu-", False),
    ],
)
def test_a_dra_device_name_is_a_dns_label_of_at_most_63_characters(name: str, label: bool) -> None:
    assert v.is_dns_label(name) is label
