"""`make mutation`: a small AST mutator over gpuguard's pure decision modules.

Each mutant (one operator at one place: `<` for `<=`, `and` for `or`, a constant off by one, a `not` dropped,
a return of None, a call statement removed, ...) runs against the fast unit tests that execute the mutated
line, chosen from one coverage pass with a context per test. It is killed when one of them fails or runs past
its timeout. Prints the kill rate per module; docs/reliability.md has the last report.

Not mutated, as wording rather than behaviour: docstrings, annotations and `Literal[...]` types, `__all__`,
log calls, the text of raised errors, the literal parts of f-strings and prose strings (a space and 20
characters or more). A survivor judged equivalent or cosmetic is listed in JUDGED with why and left out of
the rate.

Fast because nothing is imported per mutant: each worker collects the tests once (pytest, in a copy of the
repository) and forks a child per mutant, which swaps the mutated function's code object into the live
function (or re-runs the module's top-level assignments, or a function's defaults) and runs the selected
test items. A mutant in a class body is the exception: its child imports everything afresh (slow, rare).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import importlib
import importlib.util
import json
import multiprocessing
import os
import py_compile
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODULES = (
    "gpuguard/judge/policy.py",
    "gpuguard/core/model.py",
    "gpuguard/store/state.py",
    "gpuguard/core/validation.py",
    "gpuguard/core/xids.py",
    "gpuguard/quarantine/node/plan.py",
    "gpuguard/quarantine/node/view.py",
    "gpuguard/quarantine/gpu/rules.py",
    "gpuguard/quarantine/gpu/budget.py",
    "gpuguard/quarantine/gpu/order.py",
    "gpuguard/quarantine/node/budget.py",
    "gpuguard/quarantine/record.py",
    "gpuguard/quarantine/budget.py",
    "gpuguard/quarantine/gpu/plan.py",
    "gpuguard/judge/recovery.py",
    "gpuguard/judge/signals.py",
    "gpuguard/judge/cadence.py",
    "gpuguard/judge/streaks.py",
    "gpuguard/judge/flaps.py",
    "gpuguard/judge/tally.py",
    "gpuguard/judge/unanswered.py",
    "gpuguard/quarantine/repeat/escalation.py",
    "gpuguard/quarantine/repeat/counting.py",
    "gpuguard/quarantine/repeat/release.py",
    "gpuguard/quarantine/repeat/marks.py",
    "gpuguard/quarantine/gpu/degraded.py",
    "gpuguard/quarantine/gpu/slices.py",
    "gpuguard/quarantine/gpu/trust.py",
    "gpuguard/quarantine/node/degraded.py",
    "gpuguard/quarantine/handoff.py",
    "gpuguard/eviction/plan.py",
    "gpuguard/quarantine/repeat/published.py",
    "gpuguard/core/remedies.py",
    "gpuguard/quarantine/repair/ladder.py",
    "gpuguard/quarantine/repair/asking.py",
    "gpuguard/quarantine/repair/proof.py",
    "gpuguard/quarantine/repair/values.py",
    "gpuguard/quarantine/repair/bucket.py",
    "gpuguard/core/hardware.py",
    "gpuguard/judge/links.py",
    "gpuguard/judge/xidfaults.py",
    "gpuguard/judge/explained.py",
    "gpuguard/store/retry.py",
    "gpuguard/store/limits.py",
    "gpuguard/quarantine/node/accelerated.py",
    "gpuguard/quarantine/repeat/hold.py",
    "gpuguard/core/xidevent.py",
    "gpuguard/core/signaltable.py",
)
# The unit tests that run in-process in milliseconds (no fake NVML library, no subprocess, no chart).
TESTS = (
    "tests/test_policy.py",
    "tests/test_node_plan.py",
    "tests/test_devices.py",
    "tests/test_devicetrust.py",
    "tests/test_devicebudget.py",
    "tests/test_state.py",
    "tests/test_validation.py",
    "tests/test_reconciler.py",
    "tests/test_other_nodes.py",
    "tests/test_fleet.py",
    "tests/test_devicewriters.py",
    "tests/test_listwatch.py",
    "tests/test_agent.py",
    "tests/test_mock_backend.py",
    "tests/test_fuzz.py",
    "tests/test_budget.py",
    "tests/test_model.py",
    "tests/test_xidcatalog.py",
    "tests/test_fault_record.py",
    "tests/test_gpu_plan.py",
    "tests/test_streaks.py",
    "tests/test_flaps.py",
    "tests/test_unanswered.py",
    "tests/test_escalation.py",
    "tests/test_counting.py",
    "tests/test_repeat.py",
    "tests/test_degraded_node.py",
    "tests/test_degraded_devices.py",
    "tests/test_eviction_plan.py",
    "tests/test_signaljudge.py",
    "tests/test_signalcadence.py",
    "tests/test_mocksignals.py",
    "tests/test_handoff.py",
    "tests/test_recovery.py",
    "tests/test_tally.py",
    "tests/test_accelerated_condition.py",
    "tests/test_first_sight.py",
    "tests/test_event_checks.py",
    "tests/test_hold.py",
    "tests/test_evidence.py",
    "tests/test_explain.py",
    "tests/test_degraded_shown.py",
    "tests/test_signalconfig.py",
    "tests/test_kernel_log.py",
    "tests/test_operator_day.py",
    "tests/test_repair.py",
    "tests/test_repair_agent.py",
    "tests/test_repair_executor.py",
    "tests/test_hardware.py",
    "tests/test_links.py",
    "tests/test_xidfaults.py",
    "tests/test_explained.py",
    "tests/test_retry.py",
    "tests/test_limits.py",
    "tests/test_xidevent.py",
    "tests/test_signaltable.py",
)
# Survivors judged equivalent (no test could tell them apart) or cosmetic, by mutant key, with why.
_FALSY = "equivalent: the caller tests the answer for truth, and None is false like False"
_CUT = "equivalent: the cut at the bound or below it leaves the same text"
_EMPTY = "equivalent: a name no rule or node has, and no digit, counts like the empty one"
_LOGGED = "cosmetic: the value only reaches a log line (its de-duplication key included)"
_DATACLASS = (
    "not seen by the mutator: read once, when the dataclass is made (its own test file pins the default)"
)
_PRUNE = (
    "equivalent: only whether to filter; the filter keeps the episodes within the window, which is all of "
    "them when the oldest is (monotonic times are never negative)"
)
_SPLIT = "equivalent: a second split leaves the part before the first separator as it was"
_NO_UUID = "equivalent: the stand-in UUID of a fault that names none, which no GPU's action is read under"
_UNLISTED = (
    "cosmetic: the uid and node of a pod the API server does not list (kept, never evicted), read only by "
    "the evictor's log de-duplication and its node filter, which sees listed pods"
)
_OTHER_BITS = "equivalent: a sample of other clock bits as well counts toward no signal"
_PLAN_CACHE = (
    "equivalent: the per-table cache of the judged signals and its bound; recomputed, the plan is the same "
    "(a stale entry needs a freed table's id reused)"
)
_SIG = "gpuguard/judge/signals.py "
_LIMITS = "gpuguard/store/limits.py "
_TABLE = "gpuguard/core/signaltable.py "
_LEVEL = (
    "the mutant raises at import (the shipped table's levels are then unknown), which no run of a test could "
    "miss (counted as an error by the mutator)"
)
_NO_DETAIL = (
    "equivalent: a rule's empty detail means not tripped, and its caller tests it for truth (None too)"
)
_WHAT = "cosmetic: names the file in the error text that the caller catches (and logs)"
_GPU_RUN = (
    "equivalent: a GPU's run is shorter than the node's only for a GPU new to the verdict, whose runs (with "
    "and without a degraded signal) both start then: the other all() and the node's min() still hold it back"
)
_DEGRADED_ACTION = (
    "cosmetic: a degraded write then logs as a fault's, and the same pass plans the degraded marks once "
    "more (in line by then, or what the next pass would write)"
)
JUDGED: dict[str, str] = {
    "gpuguard/core/model.py <module>: 'retired-pages' -> 'XXretired-pagesXX'": (
        "not seen by the mutator: copied at import (`from gpuguard.core.model import RETIRED_PAGES`) into "
        "the modules that judge it; test_policy pins the text"
    ),
    "gpuguard/store/state.py read_boot_id: 'boot ID file' -> 'XXboot ID fileXX'": _WHAT,
    "gpuguard/store/state.py StateStore._load: 'state file' -> 'XXstate fileXX'": _WHAT,
    "gpuguard/store/state.py StateStore.save: kernel_seq > self._kernel_seq -> kernel_seq >= "
    "self._kernel_seq": "equivalent: an equal sequence number sets the value it has",
    "gpuguard/store/state.py StateStore._writable: return False -> return None": _FALSY,
    "gpuguard/judge/tally.py Tally: False -> True": (
        "equivalent: a fresh tally has no verdict, so its `settled` is never read (a verdict is never None)"
    ),
    "gpuguard/judge/tally.py _saturated: all((n >= most for n in counted.gpus.values())) -> any((n >= most "
    "for n in counted.gpus.values()))": _GPU_RUN,
    "gpuguard/judge/tally.py _saturated: all((n >= most for n in counted.gpus_clean.values())) -> any((n >= "
    "most for n in counted.gpus_clean.values()))": _GPU_RUN,
    "gpuguard/quarantine/repair/values.py parse_record: '{}' -> 'XX{}XX'": (
        "equivalent: the stand-in for an absent annotation; not JSON either, it reads as an empty record"
    ),
    "gpuguard/quarantine/node/view.py NodeView.repeat_offenders: '{}' -> 'XX{}XX'": (
        "equivalent: the stand-in for an absent annotation; not JSON either, it reads as none, like {}"
    ),
    _SIG + "_fabric_incomplete: run is not None and start is not None -> run is not None or start is not "
    "None": "equivalent: the run and its start are set together and forgotten together",
    _SIG + "_fabric_incomplete: spent >= now - start - 1e-09 -> spent > now - start - 1e-09": (
        "equivalent: the time incomplete equals the time since the start less 1e-9 s only by rounding chance"
    ),
    _SIG + "_fabric_incomplete: return '' -> return None #3": _NO_DETAIL,
    _SIG + "_fabric_incomplete: return '' -> return None #4": _NO_DETAIL,
    "gpuguard/judge/policy.py evaluate: 0 -> 1 #3": "equivalent: a shortfall needs an expected count of "
    "at least 1, so `expected or 0` in its text never falls back",
    "gpuguard/quarantine/gpu/plan.py suppressed: return False -> return None": _FALSY,
    "gpuguard/quarantine/repeat/escalation.py <module>: 4 -> 5": (
        "outside MODULES: AT_ONCE_CHECKS is read only by gpuguard/runtime/root.py (at-once window = it x "
        "--interval)"
    ),
    "gpuguard/quarantine/handoff.py Handoff.submit: 0 -> 1": (
        "equivalent: only the cache of the last judgement's summary; never a hit, the summary is computed "
        "afresh, the same"
    ),
    "gpuguard/judge/policy.py <module>: 1 -> 2": (
        "equivalent: a repeat offender's severity -2 sorts it first as -1 does (no other is negative)"
    ),
    "gpuguard/judge/policy.py _ordered: 1 -> 2": (
        "equivalent: any negative index puts the node's faults first"
    ),
    "gpuguard/store/state.py StateStore._write: return False -> return None": _FALSY,
    "gpuguard/core/validation.py <module>: 1024 -> 1025 #3": (
        "outside MODULES: MAX_EVENT_MESSAGE_BYTES is read only by gpuguard/quarantine/node/writers.py"
    ),
    "gpuguard/core/validation.py clean_text: False -> True": "equivalent: a gap before the first kept "
    "character adds no space (nothing is kept yet)",
    "gpuguard/core/validation.py fault_key: len(encoded) <= MAX_FAULT_KEY_BYTES -> len(encoded) < "
    "MAX_FAULT_KEY_BYTES": _CUT,
    "gpuguard/core/validation.py taint_key: '' -> 'XXXX'": "equivalent: a key that is not a string has no "
    "name part either, and is refused for that",
    "gpuguard/core/validation.py taint_key: '' -> 'XXXX' #2": "equivalent: the separator is not read",
    "gpuguard/quarantine/gpu/rules.py <module>: 'NoSchedule' -> 'XXNoScheduleXX'": (
        "equivalent: an effect missing from the table is NoSchedule, the entry's own value"
    ),
    "gpuguard/quarantine/gpu/rules.py DeviceRule.share: '' -> 'XXXX'": _EMPTY,
    "gpuguard/quarantine/gpu/rules.py DeviceRule.share: 0 < len(raw) <= 4 -> 0 <= len(raw) <= 4": (
        "equivalent: the empty string is not digits"
    ),
    "gpuguard/quarantine/gpu/rules.py DeviceRule.share: 1 <= gpus <= 1024 -> 1 < gpus <= 1024": (
        "equivalent: 1 GPU and the fallback are both a whole node"
    ),
    "gpuguard/quarantine/gpu/rules.py DeviceRule.share: 1 -> 2 #3": (
        "equivalent: 1 GPU and the fallback are both a whole node"
    ),
    "gpuguard/quarantine/gpu/budget.py <module>: DeviceRule | None -> DeviceRule & None": "a type alias: the "
    "mutant raises at import, which no run of a test could miss (counted as an error by the mutator)",
    "gpuguard/quarantine/gpu/budget.py RuleBudget.__init__: False -> True": (
        "equivalent: the flag is read only with a fresh rule, and blocking() sets it with the first"
    ),
    "gpuguard/quarantine/gpu/budget.py RuleBudget.room: '' -> 'XXXX'": _EMPTY,
    "gpuguard/quarantine/gpu/order.py rules_past_limit: '' -> 'XXXX' #2": (
        "equivalent: the stand-in for an invalid since: every invalid claim gets the same one, so they keep "
        "their order among themselves (by name), after every valid one"
    ),
    "gpuguard/quarantine/node/budget.py quarantine_entry: 'creationTimestamp' -> "
    "'XXcreationTimestampXX' #2": ("cosmetic: the creation time shown in the reason a claim is ignored"),
    "gpuguard/quarantine/node/budget.py OtherNodes.quarantined: '' -> 'XXXX'": _LOGGED,
    "gpuguard/quarantine/node/budget.py OtherNodes.quarantined: 253 -> 254": _LOGGED,
    "gpuguard/quarantine/node/budget.py quarantine_rank: k < me -> k <= me": (
        "equivalent: an entry equal to this node's has its name, and is left out before the comparison"
    ),
    "gpuguard/quarantine/node/budget.py limit: '' -> 'XXXX'": "equivalent: every taint change has an Event",
    "gpuguard/quarantine/node/budget.py QuarantineBudget.written: return False -> return None #2": _FALSY,
    "gpuguard/quarantine/node/budget.py QuarantineBudget._check_order: '' -> 'XXXX'": "unreachable: a fully "
    "quarantined node has gpuguard.io/since, written in the same patch as the taint",
    "gpuguard/quarantine/handoff.py Handoff._summary: 0 -> 1": "equivalent: only the cache of the verdict's "
    "fault keys; a frozenset is never the verdict, so the keys are computed afresh, the same",
    "gpuguard/quarantine/handoff.py Handoff.wait_idle: left <= 0 -> left < 0": "equivalent: a wait of "
    "exactly 0 s returns at once, and the next pass finds the deadline past",
    "gpuguard/quarantine/handoff.py Handoff.hold_start: latest is None or first is None -> latest is None "
    "and first is None": "equivalent: submit sets the first verdict's time and the latest verdict together",
    "gpuguard/quarantine/repeat/marks.py marks: '' -> 'XXXX'": (
        "equivalent: the stand-in key where there is no summary to publish, never written (`published` is "
        "tested first)"
    ),
    "gpuguard/quarantine/repeat/marks.py listed: True -> False": "equivalent: the dict is built from the "
    "items sorted by UUID, so its keys are in order either way",
    "gpuguard/quarantine/node/degraded.py <module>: 'degrade' -> 'XXdegradeXX'": _DEGRADED_ACTION,
    "gpuguard/quarantine/node/degraded.py <module>: 'degrade-clear' -> 'XXdegrade-clearXX'": _DEGRADED_ACTION,
    "gpuguard/quarantine/node/degraded.py _mark: ':' -> 'XX:XX'": (
        "equivalent: the record is a JSON list, which has no key separator"
    ),
    "gpuguard/quarantine/node/degraded.py _ours: return False -> return None": _FALSY,
    "gpuguard/quarantine/node/degraded.py DegradedRecord.first_reason: 1 -> 2": _SPLIT,
    "gpuguard/quarantine/record.py FaultRecord.primary_reason: 1 -> 2": _SPLIT,
    "gpuguard/quarantine/record.py FaultRecord.primary_reason: '' -> 'XXXX'": "equivalent: the stand-in "
    "fault's detail, which policy.primary never reads (it ranks the reasons)",
    "gpuguard/eviction/plan.py Toleration.tolerates: 'Exists' -> 'XXExistsXX' #2": "equivalent: an Exists "
    "toleration has no value (the API server refuses one with a value), so `not self.value` answers alike",
    "gpuguard/quarantine/repeat/escalation.py <module>: 3 -> 4": _DATACLASS,
    "gpuguard/quarantine/repeat/escalation.py <module>: 604800.0 -> 604801.0": _DATACLASS,
    "gpuguard/quarantine/repeat/escalation.py _node_wide: return False -> return None": _FALSY,
    "gpuguard/quarantine/repeat/counting.py counts: return False -> return None": _FALSY,
    "gpuguard/judge/cadence.py fitted: '--interval' -> 'XX--intervalXX'": "cosmetic: names the flag in the "
    "text of the error raised for a window past MAX_WINDOW_S",
    "gpuguard/judge/flaps.py observe: now - episodes[0] > window -> now - episodes[0] >= window": _PRUNE,
    "gpuguard/judge/flaps.py observe: now - episodes[0] -> now + episodes[0]": _PRUNE,
    "gpuguard/judge/unanswered.py <module>: 'K' -> 'XXKXX'": "cosmetic: a TypeVar's name, read by mypy only",
    "gpuguard/judge/recovery.py <module>: frozenset(SIGNALS.names()) - {GPU_MISSING} -> frozenset(SIGNALS"
    ".names()) + {GPU_MISSING}": "the mutant raises at import, which no run of a test could miss (counted as "
    "an error by the mutator)",
    "gpuguard/judge/recovery.py cleared_without_reboot: 1 -> 2": _SPLIT,
    "gpuguard/judge/recovery.py apply_recovery_rule: '' -> 'XXXX'": _NO_UUID,
    "gpuguard/judge/recovery.py apply_recovery_rule: '' -> 'XXXX' #2": _NO_UUID,
    "gpuguard/judge/recovery.py apply_recovery_rule: '' -> 'XXXX' #3": _NO_UUID,
    "gpuguard/judge/recovery.py unresponsive_rule: 1 -> 2": _SPLIT,
    "gpuguard/judge/recovery.py unresponsive_rule: return False -> return None": _FALSY,
    "gpuguard/quarantine/gpu/slices.py slice_devices: '' -> 'XXXX'": _EMPTY,
    "gpuguard/eviction/plan.py Toleration: 'Equal' -> 'XXEqualXX'": (
        "equivalent: every operator but Exists matches as Equal"
    ),
    "gpuguard/eviction/plan.py Pod: '' -> 'XXXX'": _UNLISTED,
    "gpuguard/eviction/plan.py Pod: '' -> 'XXXX' #2": _UNLISTED,
    "gpuguard/eviction/plan.py Pod: 'Running' -> 'XXRunningXX'": (
        "equivalent: every phase but Succeeded or Failed is a pod still running to the plan"
    ),
    "gpuguard/eviction/plan.py Pod.from_api: '' -> 'XXXX' #6": (
        "equivalent: an owner without a kind is no DaemonSet either way"
    ),
    "gpuguard/eviction/plan.py held: 1 -> 2": _SPLIT,
    "gpuguard/eviction/plan.py held: 1 -> 2 #2": _SPLIT,
    "gpuguard/eviction/plan.py mig_slices: 1 -> 2": _SPLIT,
    _SIG + "<module>: 'COMPLETED' -> 'XXCOMPLETEDXX'": (
        "equivalent: the name is shown only for a fabric not completed"
    ),
    _SIG + "<module>: 8 -> 9 #2": _OTHER_BITS,
    _SIG + "<module>: 64 -> 65 #2": _OTHER_BITS,
    _SIG + "<module>: 128 -> 129 #2": _OTHER_BITS,
    _SIG + "_Memory.keep: 1 -> 2": "equivalent: a counter's key is UUID/counter, and a UUID has no '/'",
    _SIG + "_gpu: 1 -> 2": _SPLIT,
    _SIG + "<module>: 'GpuReading' -> 'XXGpuReadingXX'": "cosmetic: a forward reference in a type alias",
    _SIG + "<module>: '_Memory' -> 'XX_MemoryXX'": "cosmetic: a forward reference in a type alias",
    _SIG + "_plan: cached[0] is not table -> cached[0] is table": _PLAN_CACHE,
    _SIG + "_plan: 0 -> 1": _PLAN_CACHE,
    _SIG + "_plan: len(_PLANS) > 64 -> len(_PLANS) >= 64": _PLAN_CACHE,
    _SIG + "_plan: 64 -> 65": _PLAN_CACHE,
    _SIG + "_plan: _PLANS.clear() -> pass": _PLAN_CACHE,
    _SIG + "_fabric_incomplete: boot < now -> boot <= now": (
        "equivalent: a boot at now starts the grace at now either way"
    ),
    _SIG + "_counter: break -> continue": (
        "equivalent: the samples are in time order: after the first within the window, none is at or "
        "before its start"
    ),
    _SIG + "_clock_sample: samples[0][0] <= now - keep_s -> samples[0][0] < now - keep_s": _PRUNE,
    _SIG + "_clock_sample: now - keep_s -> now + keep_s": _PRUNE,
    _SIG + "_clock_sample: x[0] > now - keep_s -> x[0] >= now - keep_s": (
        "equivalent: a sample exactly the longest window old is within no window (each counts after its "
        "start)"
    ),
    _SIG + "_fabric_incomplete: return '' -> return None": _NO_DETAIL,
    _SIG + "_fabric_incomplete: return '' -> return None #2": _NO_DETAIL,
    _SIG + "_fabric_status: return '' -> return None": _NO_DETAIL,
    _SIG + "_fabric_degraded: return '' -> return None": _NO_DETAIL,
    _SIG + "_nvlink_errors: return '' -> return None": _NO_DETAIL,
    _SIG + "_pcie_replays: return '' -> return None": _NO_DETAIL,
    _SIG + "_pcie_width_max: return '' -> return None": _NO_DETAIL,
    _SIG + "_pcie_gen: return '' -> return None": _NO_DETAIL,
    _SIG + "_pcie_gen: return '' -> return None #2": _NO_DETAIL,
    _SIG + "_clock: return '' -> return None": _NO_DETAIL,
    _SIG + "_clock: return '' -> return None #2": _NO_DETAIL,
    _SIG + "_retired_pages: return '' -> return None": _NO_DETAIL,
    "gpuguard/quarantine/repair/bucket.py take: 0 <= tokens <= bucket.burst -> 0 <= tokens < bucket.burst": (
        "equivalent: a count of exactly `burst` is a full bucket either way (a full one refills nothing)"
    ),
    "gpuguard/judge/links.py nvlink_down: active <= first -> active < first": (
        "equivalent: raising a baseline by the links it already has leaves it as it was"
    ),
    "gpuguard/judge/links.py nvlink_down: '' -> 'XXXX' #2": (
        "unreachable: the product's rule trips only with fewer links active than the product has, so some of "
        "its links are inactive"
    ),
    "gpuguard/judge/links.py pcie_width: width > first -> width >= first": (
        "equivalent: raising the baseline to the width it already is leaves it as it was"
    ),
    "gpuguard/store/retry.py WriteRetry.__init__: 0.0 -> 1.0": (
        "equivalent: the retry time is read only after a failure, which sets it first"
    ),
    "gpuguard/store/retry.py WriteRetry.failed: 16 -> 17": (
        "equivalent: only a cap on the exponent (no huge power after days of failures); 5 s x 2^16 is "
        "far past MOST_S either way"
    ),
    _LIMITS + "kept_faults: len(faults) <= STATE_MAX_FAULTS -> len(faults) < STATE_MAX_FAULTS": (
        "equivalent: exactly the limit's faults through the trim keep every one of them, in order"
    ),
    _LIMITS + "_cut: len(f.reason) <= STATE_MAX_REASON -> len(f.reason) < STATE_MAX_REASON": _CUT,
    _LIMITS + "_cut: len(f.detail) <= STATE_MAX_DETAIL -> len(f.detail) < STATE_MAX_DETAIL": _CUT,
    _TABLE + "<module>: 'fault' -> 'XXfaultXX'": _LEVEL,
    _TABLE + "<module>: 'degraded' -> 'XXdegradedXX'": _LEVEL,
    _TABLE + "<module>: 'ignore' -> 'XXignoreXX'": _LEVEL,
    _TABLE + "load: 1000000000000000.0 -> 1000000000000001.0": (
        "equivalent: no shipped threshold is near the bound (the bound itself is pinned through `changed`)"
    ),
    "gpuguard/quarantine/node/accelerated.py owned_by_another: '' -> 'XXXX'": (
        "equivalent: a condition without a message is another writer's either way (neither text starts "
        "with gpuguard's prefix)"
    ),
}

_SWAP_CMP = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}  # fmt: skip
_SWAP_BIN = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.BitOr: ast.BitAnd, ast.BitAnd: ast.BitOr,
}  # fmt: skip
_SWAP_CALL = {"all": "any", "any": "all", "min": "max", "max": "min"}
_FUNC = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Mutant:
    module: str
    index: int  # the place's order in the walk
    variant: int
    line: int
    lines: tuple[int, ...]  # the enclosing statement's lines, for the coverage look-up
    # How the child applies it: "function" (swap the code of `target`), "defaults" (of `target`), "global"
    # (re-run the module's top-level assignments), "fresh" (import everything again).
    how: str
    target: str
    key: str  # stable across line shifts: module, enclosing function, the change
    desc: str


# -- generating mutants ----------------------------------------------------------------------------------

Place = tuple[ast.AST, str, int | None, ast.AST, ast.stmt | None, str, str, str]


def _places(tree: ast.Module) -> Iterator[Place]:
    """(parent, field, position, node, enclosing statement, qualname, how, target) in a fixed order, leaving
    out what is wording rather than behaviour."""

    def walk(node: ast.AST, stmt: ast.stmt | None, qual: str, how: str, target: str) -> Iterator[Place]:
        for name, value in ast.iter_fields(node):
            if name in ("annotation", "returns", "type_comment", "decorator_list"):
                continue
            for pos, child in enumerate(value if isinstance(value, list) else [value]):
                if not isinstance(child, ast.AST) or _skipped(node, child):
                    continue
                h, t, q = how, target, qual
                if isinstance(node, ast.Module):
                    simple = isinstance(child, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Expr)
                    h, t, q = ("global" if simple else "fresh"), "", ""
                elif isinstance(node, _FUNC) and how != "function":
                    # A function's body runs when it is called (its code is swapped), its defaults when the
                    # module is imported (they are replaced).
                    q = t = f"{qual}.{node.name}" if qual else node.name
                    h = "function" if name == "body" else "defaults"
                elif isinstance(node, ast.ClassDef) and how != "function":
                    h, t, q = "fresh", "", f"{qual}.{node.name}" if qual else node.name
                s = child if isinstance(child, ast.stmt) else stmt
                yield node, name, pos if isinstance(value, list) else None, child, s, q, h, t
                yield from walk(child, s, q, h, t)

    yield from walk(tree, None, "", "global", "")


def _skipped(parent: ast.AST, node: ast.AST) -> bool:
    if (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ):
        return True  # a docstring
    if isinstance(node, ast.Raise | ast.Assert | ast.Import | ast.ImportFrom | ast.Global):
        return True
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
    ):
        return True  # the names a star import takes: read by mypy and ruff, by no running code
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
        return True  # a type's values (a Literal alias): read by mypy, by no running code
    call = node.value if isinstance(node, ast.Expr | ast.Assign) else node
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
        f = call.func
        if (isinstance(f.value, ast.Name) and f.value.id == "log") or f.attr == "get_logger":
            return True  # a log line, or the logger's name
    if isinstance(node, ast.If) and not node.orelse and all(_skipped(node, b) for b in node.body):
        return True  # a condition for a log line only
    return isinstance(parent, ast.JoinedStr) and isinstance(node, ast.Constant)


def _variants(node: ast.AST) -> list[ast.AST]:
    """The mutations of one node, each a replacement for it."""
    out: list[ast.AST] = []
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _SWAP_CMP:
                cmp = copy.deepcopy(node)
                cmp.ops[i] = _SWAP_CMP[type(op)]()
                out.append(cmp)
    elif isinstance(node, ast.BoolOp):
        out.append(ast.BoolOp(op=ast.Or() if isinstance(node.op, ast.And) else ast.And(), values=node.values))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub):
        out.append(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _SWAP_BIN and not _is_text(node):
        out.append(ast.BinOp(left=node.left, op=_SWAP_BIN[type(node.op)](), right=node.right))
    elif isinstance(node, ast.AugAssign) and type(node.op) in (ast.Add, ast.Sub):
        aug: ast.operator = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
        out.append(ast.AugAssign(target=node.target, op=aug, value=node.value))
    elif isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool):
            out.append(ast.Constant(not v))
        elif isinstance(v, int | float):
            out.append(ast.Constant(v + 1))
        elif isinstance(v, str) and not (" " in v and len(v) >= 20):
            out.append(ast.Constant(f"XX{v}XX"))
    elif isinstance(node, ast.Return) and node.value is not None and not _is_none(node.value):
        out.append(ast.Return(value=ast.Constant(None)))
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        out.append(ast.Pass())
    elif isinstance(node, ast.Break | ast.Continue):
        out.append(ast.Continue() if isinstance(node, ast.Break) else ast.Break())
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SWAP_CALL:
        out.append(ast.Call(func=ast.Name(_SWAP_CALL[node.func.id], ast.Load()), args=node.args, keywords=[]))
    if isinstance(node, ast.If | ast.While | ast.IfExp) and not isinstance(
        node.test, ast.Compare | ast.BoolOp
    ):
        cond = copy.deepcopy(node)
        cond.test = ast.UnaryOp(op=ast.Not(), operand=cond.test)
        out.append(cond)
    return out


def _is_text(node: ast.BinOp) -> bool:
    sides = (node.left, node.right)
    return any(
        isinstance(s, ast.JoinedStr) or (isinstance(s, ast.Constant) and isinstance(s.value, str))
        for s in sides
    )


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _stmt_lines(stmt: ast.stmt | None, node: ast.AST) -> tuple[int, ...]:
    if stmt is None:
        return (getattr(node, "lineno", 0),)
    end = stmt.end_lineno or stmt.lineno
    body = getattr(stmt, "body", None)
    if isinstance(body, list) and body:
        end = max(stmt.lineno, body[0].lineno - 1)  # a compound statement: its header only
    return tuple(range(stmt.lineno, end + 1))


def mutants(root: Path, module: str) -> list[Mutant]:
    out: list[Mutant] = []
    seen: dict[str, int] = {}
    for index, (_, _, _, node, stmt, qual, how, target) in enumerate(
        _places(ast.parse((root / module).read_text()))
    ):
        for variant, new in enumerate(_variants(node)):
            desc = f"{_short(node)} -> {_short(new)}"
            key = f"{module} {qual or '<module>'}: {desc}"
            seen[key] = seen.get(key, 0) + 1
            key += f" #{seen[key]}" if seen[key] > 1 else ""
            line = getattr(node, "lineno", stmt.lineno if stmt else 0)
            out.append(Mutant(module, index, variant, line, _stmt_lines(stmt, node), how, target, key, desc))
    return out


def _short(node: ast.AST) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= 70 else text[:67] + "..."


def mutated_tree(root: Path, m: Mutant) -> ast.Module:
    tree = ast.parse((root / m.module).read_text())
    for index, (parent, field, pos, node, *_) in enumerate(_places(tree)):
        if index == m.index:
            new = _variants(node)[m.variant]
            if pos is None:
                setattr(parent, field, new)
            else:
                getattr(parent, field)[pos] = new
            return ast.fix_missing_locations(tree)
    raise LookupError(m.key)


# -- the coverage pass (a subprocess: the workers must not have imported the modules) --------------------


def coverage_pass(root: Path, modules: list[str], tests: list[str], out: Path) -> None:
    import coverage
    import pytest

    cov = coverage.Coverage(data_file=None, include=[str(root / m) for m in modules])

    class Contexts:
        def __init__(self) -> None:
            self.seconds: dict[str, float] = {}  # wall clock, for a mutant's timeout
            self.cpu: dict[str, float] = {}  # this process's CPU time, for which tests are fast
            self.failed: set[str] = set()

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> Iterator[None]:
            cov.switch_context(item.nodeid)
            start, cpu = time.perf_counter(), time.process_time()
            yield
            self.seconds[item.nodeid] = time.perf_counter() - start
            self.cpu[item.nodeid] = time.process_time() - cpu
            cov.switch_context("")

        def pytest_runtest_logreport(self, report: Any) -> None:
            if report.failed:
                self.failed.add(report.nodeid)

    plugin = Contexts()
    os.chdir(root)
    cov.start()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", *tests], plugins=[plugin])
    cov.stop()
    data = cov.get_data()
    lines = {
        Path(path).resolve().relative_to(root.resolve()).as_posix(): {
            str(n): sorted(c for c in ctx if c) for n, ctx in data.contexts_by_lineno(path).items()
        }
        for path in data.measured_files()
    }
    doc = {
        "exit": int(code),
        "seconds": plugin.seconds,
        "cpu": plugin.cpu,
        "failed": sorted(plugin.failed),
        "lines": lines,
    }
    out.write_text(json.dumps(doc))


# -- running mutants: a worker per core, a forked child per mutant ---------------------------------------


def _module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def _live(module: types.ModuleType, qualname: str) -> types.FunctionType:
    """The function object a qualname names (the getter of a property, the function of a cached_property
    or a static or class method)."""
    obj: Any = module
    for part in qualname.split("."):
        obj = vars(obj)[part]
    for attr in ("fget", "func", "__func__"):
        obj = getattr(obj, attr, obj)
    if not isinstance(obj, types.FunctionType):
        raise LookupError(qualname)
    return obj


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _apply(root: Path, m: Mutant, tree: ast.Module) -> None:
    """Makes the live module behave as the mutant (in the child: the parent never sees it)."""
    module = sys.modules[_module_name(m.module)]
    path = str(root / m.module)
    if m.how == "function":
        live = _live(module, m.target)
        (code,) = [c for c in _codes(compile(tree, path, "exec")) if c.co_qualname == m.target]
        live.__code__ = code
    elif m.how == "defaults":
        _set_defaults(module, dict(_defs(tree))[m.target], _live(module, m.target), path)
    else:  # "global": the module's top-level assignments again, and every importer's copy rebound
        simple: list[ast.stmt] = [
            s for s in tree.body if isinstance(s, ast.Assign | ast.AnnAssign | ast.AugAssign)
        ]
        before = dict(vars(module))
        exec(compile(ast.Module(body=simple, type_ignores=[]), path, "exec"), vars(module))
        changed = {k: (v, vars(module)[k]) for k, v in before.items() if vars(module)[k] is not v}
        for other in list(sys.modules.values()):
            if other is module or not other.__name__.startswith(("gpuguard", "tests")):
                continue
            for name, value in list(vars(other).items()):
                old, new = changed.get(name, (None, None))
                if old is not None and value is old:
                    setattr(other, name, new)
        for qualname, node in _defs(tree):  # defaults read the constants when the module was imported
            with contextlib.suppress(LookupError, KeyError):
                _set_defaults(module, node, _live(module, qualname), path)


def _defs(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """The module's functions and its classes' methods, by qualname."""
    for node in tree.body:
        if isinstance(node, _FUNC):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from ((f"{node.name}.{f.name}", f) for f in node.body if isinstance(f, _FUNC))


def _set_defaults(module: types.ModuleType, node: ast.AST, live: types.FunctionType, path: str) -> None:
    """`live` gets the default values `node` (a def) computes now."""
    node = copy.copy(node)
    assert isinstance(node, _FUNC)
    node.decorator_list = []
    scratch = dict(vars(module))
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), scratch)
    live.__defaults__, live.__kwdefaults__ = (
        scratch[node.name].__defaults__,
        scratch[node.name].__kwdefaults__,
    )


def _fresh(root: Path, m: Mutant, tree: ast.Module, nodeids: list[str]) -> int:
    """A mutant in a class body: its module and every test are imported again from an unchecked .pyc."""
    src = root / m.module
    pyc = Path(importlib.util.cache_from_source(str(src)))
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(ast.unparse(tree))
    mode = py_compile.PycInvalidationMode.UNCHECKED_HASH
    py_compile.compile(f.name, cfile=str(pyc), dfile=str(src), doraise=True, invalidation_mode=mode)
    os.unlink(f.name)
    for name in [n for n in sys.modules if n.startswith(("gpuguard", "tests"))]:
        del sys.modules[name]
    import pytest

    try:
        return int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *nodeids]))
    finally:
        pyc.unlink(missing_ok=True)


class _Loop:
    """The worker's pytest plugin: the session is collected once, then each mutant's child runs its items."""

    def __init__(self, root: Path, tasks: Any, results: Any) -> None:
        self.root, self.tasks, self.results = root, tasks, results

    def pytest_runtestloop(self, session: Any) -> bool:
        from _pytest.runner import runtestprotocol

        items = {i.nodeid: i for i in session.items}
        while (task := self.tasks.get()) is not None:
            m, nodeids, timeout = task
            started = time.monotonic()
            pid = os.fork()
            if pid == 0:
                code = 99
                try:
                    tree = mutated_tree(self.root, m)
                    if m.how == "fresh":
                        code = _fresh(self.root, m, tree, nodeids)
                    else:
                        _apply(self.root, m, tree)
                        failed = (
                            r.failed
                            for i in nodeids
                            for r in runtestprotocol(items[i], nextitem=None, log=False)
                        )
                        code = int(any(failed))
                finally:
                    os._exit(code)
            self.results.put((m.key, _wait(pid, timeout), time.monotonic() - started))
        return True


def _wait(pid: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
            return "survived" if status == 0 else "error" if status in (5, 99) else "killed"
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.005)


def _worker(root: str, tree: str, tests: list[str], tasks: Any, results: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    shutil.copytree(
        root, tree, ignore=shutil.ignore_patterns(".git", ".venv", "build", "__pycache__", ".*_cache")
    )
    os.chdir(tree)
    sys.path.insert(0, tree)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    import pytest

    args = ["-q", "-p", "no:cacheprovider", "-o", "addopts=", "-o", "timeout=0", *tests]
    pytest.main(args, plugins=[_Loop(Path(tree), tasks, results)])


def select(m: Mutant, lines: dict[str, list[str]], fast: set[str]) -> list[str]:
    if m.how == "function":
        chosen = {c for n in m.lines for c in lines.get(str(n), ())}
    else:  # runs at import: every test that runs any of the module, and its own test file (a dataclass's
        # defaults run in generated code, which no line of the module records)
        own = f"tests/test_{Path(m.module).stem}.py::"
        chosen = {c for ctx in lines.values() for c in ctx} | {t for t in fast if t.startswith(own)}
    return sorted(chosen & fast)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--root", type=Path, default=ROOT)
    p.add_argument("--module", action="append", help="a module to mutate (default: MODULES)")
    p.add_argument("--tests", action="append", help="a test file to run (default: the fast unit tests)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--sample", type=int, default=0, help="at most this many mutants a module, a seeded sample"
    )
    p.add_argument("--seed", type=int, default=23)
    p.add_argument(
        "--max-test-seconds",
        type=float,
        default=2.0,
        help="tests that take more CPU time (under coverage) are not run on mutants",
    )
    p.add_argument("--json", type=Path, help="write every mutant's result here")
    p.add_argument("--coverage-pass", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    root = a.root.resolve()
    modules, tests = a.module or list(MODULES), a.tests or list(TESTS)
    if a.coverage_pass:
        coverage_pass(root, modules, tests, a.coverage_pass)
        return 0
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gpuguard-mutation-"))
    try:
        cmd = [sys.executable, __file__, "--root", str(root), "--coverage-pass", str(work / "coverage.json")]
        cmd += [f"--module={m}" for m in modules] + [f"--tests={t}" for t in tests]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        cov = json.loads((work / "coverage.json").read_text())
        fast = {t for t, s in cov["cpu"].items() if s <= a.max_test_seconds} - set(cov["failed"])
        slow = len(cov["seconds"]) - len(fast) - len(cov["failed"])
        n, bad, took = len(cov["seconds"]), len(cov["failed"]), time.monotonic() - started
        print(f"coverage pass: {n} tests, {bad} failing and {slow} slower than {a.max_test_seconds} s "
              f"of CPU (not run on mutants), {took:.0f} s", flush=True)  # fmt: skip
        for t in cov["failed"]:
            print(f"  failing without a mutant: {t}", flush=True)
        rng = random.Random(a.seed)
        tasks = []
        for module in modules:
            ms = mutants(root, module)
            if a.sample and len(ms) > a.sample:
                ms = sorted(rng.sample(ms, a.sample), key=lambda m: (m.index, m.variant))
            for m in ms:
                ids = select(m, cov["lines"].get(module, {}), fast)
                tasks.append(
                    (m, ids, (60.0 if m.how == "fresh" else 10.0) + 3 * sum(cov["seconds"][t] for t in ids))
                )
        results = _run_all(root, work, tests, tasks, a.jobs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    full = not a.sample and modules == list(MODULES)
    _report([t[0] for t in tasks], results, time.monotonic() - started, a.json, full=full)
    return 0


def _run_all(root: Path, work: Path, tests: list[str], tasks: list[Any], jobs: int) -> dict[str, str]:
    ctx = multiprocessing.get_context("fork")
    queue, results = ctx.Queue(), ctx.Queue()
    out = {m.key: "no-tests" for m, ids, _ in tasks if not ids}
    for task in tasks:
        if task[1]:
            queue.put(task)
    workers = [
        ctx.Process(
            target=_worker, args=(str(root), str(work / f"tree-{i}"), tests, queue, results), daemon=True
        )
        for i in range(jobs)
    ]
    for w in workers:
        queue.put(None)
        w.start()
    while len(out) < len(tasks):
        key, verdict, _ = results.get()
        out[key] = verdict
        if len(out) % 100 == 0:
            print(f"  {len(out)}/{len(tasks)} mutants", flush=True)
    for w in workers:
        w.join()
    return out


@dataclass
class _Tally:
    mutants: int = 0
    killed: int = 0
    judged: int = 0
    untested: int = 0

    @property
    def rate(self) -> float:
        counted = self.mutants - self.judged
        return 100.0 * self.killed / counted if counted else 100.0

    def row(self, name: str) -> str:
        return (
            f"{name:32} {self.mutants:8} {self.killed:7} {self.judged:7} {self.untested:8} {self.rate:9.1f}%"
        )


def _report(
    ms: list[Mutant], results: dict[str, str], seconds: float, out: Path | None, *, full: bool
) -> None:
    tally: dict[str, _Tally] = {}
    survivors: list[tuple[Mutant, str]] = []
    for m in ms:
        verdict = results[m.key]
        t = tally.setdefault(m.module, _Tally())
        t.mutants += 1
        if verdict in ("killed", "timeout"):
            t.killed += 1
        elif m.key in JUDGED:
            t.judged += 1
        else:
            t.untested += verdict == "no-tests"
            survivors.append((m, verdict))
    total = _Tally(
        *(sum(getattr(t, f) for t in tally.values()) for f in ("mutants", "killed", "judged", "untested"))
    )
    print(f"\n{'module':32} {'mutants':>8} {'killed':>7} {'judged':>7} {'no test':>8} {'kill rate':>10}")
    print("\n".join([t.row(module) for module, t in tally.items()] + [total.row("all")]))
    errors = sum(1 for v in results.values() if v == "error")
    print(f"{seconds:.0f} s; {errors} mutants could not run (error)")
    if survivors:
        print("\nsurvivors (not judged):")
        print("\n".join(f"  {m.module}:{m.line} [{verdict}] {m.key}" for m, verdict in survivors))
    stale = set(JUDGED) - {m.key for m in ms}
    if stale and full:
        print(f"\n{len(stale)} judged keys match no mutant (the code moved on): {sorted(stale)[:5]}")
    if out is not None:
        out.write_text(json.dumps([{**asdict(m), "result": results[m.key]} for m in ms], indent=1))


if __name__ == "__main__":
    sys.exit(main())
