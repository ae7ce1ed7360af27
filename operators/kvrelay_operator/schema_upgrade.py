"""The CRD schema of `spec.upgrade` and `status.rollout` (see upgrade.py and rolling.py),
built as data; `service_schema.py` places them. Defaults must match `upgrade.py` (a test
checks)."""

from __future__ import annotations

from kvrelay_operator.schema_parts import Schema, int32, string
from kvrelay_operator.upgrade import (
    DEFAULT_MAX_SURGE,
    DEFAULT_PROGRESS_DEADLINE_S,
    FOLLOW_MODES,
    ONE_AT_A_TIME,
    ROLLING,
    STRATEGIES,
)

ROLLOUT_PHASES = ("Waiting", "Rolling", "Switched", "Complete", "RolledBack")
TRIGGERS = ("Spec", "OperatorDefaults")


def upgrade_schema() -> Schema:
    return {
        "type": "object",
        "description": "How a new worker revision (image, model, engine flags, any worker "
        "pod setting) replaces the running one.",
        "default": {},
        "properties": {
            "strategy": string(
                "Rolling: the new revision grows while the old one drains, within maxSurge "
                "extra pods (fits a full cluster). BlueGreen: a full second copy first.",
                enum=list(STRATEGIES),
                default=ROLLING,
            ),
            "maxSurge": int32(
                "Rolling: worker pods allowed over the pools' sizes during the roll.",
                minimum=0,
                maximum=1000,
                default=DEFAULT_MAX_SURGE,
            ),
            "progressDeadlineSeconds": int32(
                "A roll with no progress for this long is reported (Progressing=False).",
                minimum=60,
                default=DEFAULT_PROGRESS_DEADLINE_S,
            ),
            "autoRollback": {
                "type": "boolean",
                "description": "Past the deadline, scale the old revision back and remove "
                "the new one; the next edit of the spec tries again.",
                "default": False,
            },
            "followOperatorDefaults": string(
                "With spec.image empty, when a new operator default image rolls this "
                "service: Immediate, OneAtATime (one such service at a time across the "
                "operator's namespaces) or Never (until this field or the spec's image "
                "changes).",
                enum=list(FOLLOW_MODES),
                default=ONE_AT_A_TIME,
            ),
        },
    }


def rollout_status_schema() -> Schema:
    sizes = {
        "type": "object",
        "properties": {"prefill": int32("Prefill workers."), "decode": int32("Decode workers.")},
    }
    return {
        "type": "object",
        "description": "A Rolling upgrade: from which revision to which, and how far.",
        "properties": {
            "from": string("The revision being replaced."),
            "to": string("The revision being rolled out."),
            "phase": string("Where the roll is.", enum=list(ROLLOUT_PHASES)),
            "newGroups": sizes,
            "progressMark": string("What last counted as progress (new ready, old size)."),
            "progressAt": {"type": "string", "format": "date-time"},
            "specGeneration": {
                "type": "integer",
                "format": "int64",
                "description": "RolledBack: the spec edit rolled back; a later edit retries.",
            },
            "message": string("Why the roll waits, if it does."),
            "trigger": string(
                "Spec: a spec edit; OperatorDefaults: the operator's default image.",
                enum=list(TRIGGERS),
            ),
            "queuedAt": {
                "type": "string",
                "format": "date-time",
                "description": "OperatorDefaults: when this roll started waiting its turn.",
            },
        },
    }


def image_status_schema() -> Schema:
    return {
        "type": "object",
        "description": "The image the serving revision (status.generation) was rendered "
        "with, and where the operator's default differs.",
        "properties": {
            "rendered": string("The image the serving revision's workers run."),
            "pinned": {"type": "boolean", "description": "Whether spec.image named it."},
            "newerDefault": string(
                "The operator's default image, where it differs from the rendered one."
            ),
        },
    }
