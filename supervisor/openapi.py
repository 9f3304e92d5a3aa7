"""The OpenAPI 3.1 document of the HTTP API, served at ``/openapi.json``.

Hand-written, and checked against the running service by schemathesis in the tests, so
it cannot drift from the handlers unnoticed.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from supervisor import __version__
from supervisor.exclusions import REASONS
from supervisor.states import OpState, RunState
from supervisor.tickrules import SCHEDULE_NAME
from supervisor.tickrules import TICK_KEY as TICK_KEY  # the webhook's header rule, named here too

_ERROR = {"$ref": "#/components/schemas/Error"}
# What supervisor.sources.check_recipient_id accepts: no control characters, and not
# only whitespace. (Lone surrogates cannot arrive: the JSON parser refuses them.)
_CHARS = r"[^\x00-\x1f\x7f-\x9f]"
PRINTABLE = rf"^{_CHARS}*[^\s\x00-\x1f\x7f-\x9f]{_CHARS}*$"


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "bad request", 401: "missing or wrong token",
            403: "the token does not grant this (see the security schemes)", 404: "not found",
            409: "conflict", 413: "body too large", 415: "body must be JSON",
            429: "held: try again after Retry-After (too many failed authentications from "
                 "this client or overall; for a push delivery, the partner's limit)",
            503: "not accepting (shutting down or ledger fault)"}
    if 401 in codes:  # every route behind a token: its scope, and the failure throttle
        codes = tuple(sorted({*codes, 403, 429}))
    return {str(c): {"description": text[c],
                     "content": {"application/json": {"schema": _ERROR}}} for c in codes}


# A read held open past its cap (service.max_long_polls, max_exclusion_reads).
_BUSY = {"429": {"description": "too many held open, in all or for this token: ask again "
                                "after Retry-After",
                 "headers": {"Retry-After": {"schema": {"type": "integer"}}},
                 "content": {"application/json": {"schema": _ERROR}}}}


def _ok(description: str, schema: dict[str, Any], status: str = "200") -> dict[str, Any]:
    return {status: {"description": description,
                     "content": {"application/json": {"schema": schema}}}}


_PAGE_PARAMS = [
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                   "maximum": 1000}},
    {"name": "after", "in": "query", "description": "the previous page's next_after",
     "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{0,200}$"}},
]
_STATE = {"type": "string", "enum": [s.value for s in OpState]}
_NUM_OR_NULL = {"type": ["number", "null"]}
_STR_OR_NULL = {"type": ["string", "null"]}

DOCUMENT: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "cleanup-supervisor", "version": __version__,
             "description": "Ticks open runs; runs are paced, idempotent streams of deletions. "
                            "A Host header outside service.allowed_hosts is answered 421."},
    # Reads: the viewer's token or the operator's.
    "security": [{"viewer": []}, {"operator": []}],
    "paths": {
        "/v1/runs": {
            "post": {
                "summary": "A tick: open a run, or return the one this tick already opened",
                "security": [{"tick": []}, {"operator": []}],
                "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False,
                                "schema": {"type": "string", "pattern": TICK_KEY}}],
                "requestBody": {"required": False, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Tick"}}}},
                "responses": {
                    **_ok("the run this tick opened", {"$ref": "#/components/schemas/Opened"},
                          "201"),
                    **_ok("the run a previous delivery of this tick opened",
                          {"$ref": "#/components/schemas/Opened"}),
                    **_errors(400, 401, 409, 413, 415, 503)},
            },
            "get": {
                "summary": "Runs, newest first",
                "parameters": [
                    {"name": "limit", "in": "query",
                     "schema": {"type": "integer", "minimum": 1, "maximum": 200}},
                    {"name": "before", "in": "query", "schema": {"type": "string"}}],
                "responses": {**_ok("runs", {"type": "object", "required": ["runs"],
                                             "properties": {"runs": {"type": "array", "items": {
                                                 "$ref": "#/components/schemas/Run"}}}}),
                              **_errors(400, 401)},
            },
        },
        "/v1/runs/{run_id}": {
            "get": {
                "summary": "One run with counts per state; wait=done long-polls",
                "parameters": [
                    {"name": "run_id", "in": "path", "required": True,
                     "schema": {"type": "string"}},
                    {"name": "wait", "in": "query", "schema": {"type": "string",
                                                                "enum": ["done"]}},
                    {"name": "timeout", "in": "query",
                     "schema": {"type": "integer", "minimum": 0, "maximum": 60}}],
                "responses": {**_ok("the run", {"$ref": "#/components/schemas/Run"}),
                              **_errors(400, 401, 404, 503), **_BUSY},
            },
        },
        "/v1/runs/{run_id}/operations": {
            "get": {
                "summary": "A run's operations, optionally in one state, paged by next_after",
                "parameters": [{"name": "run_id", "in": "path", "required": True,
                                "schema": {"type": "string"}},
                               {"name": "state", "in": "query", "schema": _STATE},
                               *_PAGE_PARAMS],
                "responses": {**_ok("operations", {"$ref": "#/components/schemas/OpPage"}),
                              **_errors(400, 401, 404)},
            },
        },
        "/v1/exclusions": {
            "get": {
                "summary": "The digest rule: every recipient of a schedule's current run, "
                           "with the reason the digest must exclude it",
                "parameters": [
                    {"name": "schedule", "in": "query",
                     "schema": {"type": "string", "pattern": SCHEDULE_NAME}},
                    {"name": "format", "in": "query", "description": "jsonl: stream them all",
                     "schema": {"type": "string", "enum": ["json", "jsonl"]}},
                    *_PAGE_PARAMS],
                "responses": {
                    "200": {"description": "a page of exclusions, or every one as JSON lines "
                                           "ending with {\"end\": true, \"count\": n}",
                            "content": {
                                "application/json": {"schema": {
                                    "$ref": "#/components/schemas/ExclusionPage"}},
                                "application/x-ndjson": {"schema": {"type": "string"}}}},
                    **_errors(400, 401, 404, 409), **_BUSY},
            },
        },
        "/v1/operations": {
            "get": {
                "summary": "Operations in one state across runs (e.g. ambiguous)",
                "parameters": [{"name": "state", "in": "query", "required": True,
                                "schema": _STATE}, *_PAGE_PARAMS],
                "responses": {**_ok("operations", {"$ref": "#/components/schemas/OpPage"}),
                              **_errors(400, 401)},
            },
        },
        "/v1/operations/{operation_id}": {
            "get": {
                "summary": "One operation and a page of its attempts log",
                "parameters": [{"name": "operation_id", "in": "path", "required": True,
                                "schema": {"type": "string"}},
                               {"name": "attempts_limit", "in": "query",
                                "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                               {"name": "attempts_after", "in": "query",
                                "description": "the previous page's attempts_next",
                                "schema": {"type": "integer", "minimum": 0,
                                           "maximum": 2**31 - 1}}],
                "responses": {**_ok("the operation", {"$ref": "#/components/schemas/Operation"}),
                              **_errors(400, 401, 404)},
            },
        },
        "/v1/operations/{operation_id}/resolve": {
            "post": {
                "summary": "An operator's decision on an ambiguous operation",
                "security": [{"operator": []}],
                "parameters": [{"name": "operation_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Resolution"}}}},
                "responses": {**_ok("resolved", {"type": "object",
                                                 "required": ["id", "state"],
                                                 "properties": {"id": {"type": "string"},
                                                                "state": _STATE}}),
                              **_errors(400, 401, 404, 409, 413, 415)},
            },
        },
        "/v1/budget": {
            "get": {
                "summary": "The rate budget: what holds the workers now, and the latest "
                           "resumes",
                "responses": {**_ok("the budget", {"$ref": "#/components/schemas/Budget"}),
                              **_errors(401, 404)},
            },
        },
        "/v1/budget/resume": {
            "post": {
                "summary": "An operator lifts the pause (and the partner's spent quotas), "
                           "for every worker of every replica; recorded with who and why",
                "description": (
                    "forget_limit also forgets the limit learnt from 429s and the one the "
                    "partner announced: pacing starts afresh at the ceiling. A partner "
                    "that pauses again is obeyed again (for at most "
                    "partner.max_retry_after_seconds)."),
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Resume"}}}},
                "responses": {
                    **_ok("resumed", {"type": "object", "required": ["action", "budget"],
                                      "properties": {
                                          "action": {"$ref": "#/components/schemas/"
                                                             "OperatorAction"},
                                          "budget": {"$ref": "#/components/schemas/Budget"}}}),
                    **_errors(400, 401, 404, 413, 415, 503)},
            },
        },
        "/v1/push/{queue}": {
            "post": {
                "security": [],
                "summary": "One Infrai push delivery of a subscribed queue's message",
                "description": (
                    "Authenticated by its signature, not a bearer token: the signature "
                    "header (infrai.push_signature_header) carries the hex HMAC-SHA256, "
                    "optionally prefixed 'sha256=', of '<timestamp>.' + body (or of the "
                    "body alone, infrai.push_signature_scheme = 'body', which has no replay "
                    "protection and needs infrai.allow_unsigned_timestamp) with the push "
                    "secret; the timestamp (Unix seconds) must be within the tolerance. "
                    "A copy of a delivery seen within the tolerance (the same message_id "
                    "and signature) is answered as that one was, and not worked again. "
                    "A 2xx acknowledges the delivery only after the ledger committed its "
                    "outcome; 429 (the limiter holds) and 503 (a retry wait, a fault) carry "
                    "Retry-After and mean: deliver it again later."),
                "parameters": [
                    {"name": "queue", "in": "path", "required": True,
                     "schema": {"type": "string"}},
                    {"name": "X-Infrai-Signature", "in": "header", "required": False,
                     "description": "default name; required in fact (401 without it)",
                     "schema": {"type": "string"}},
                    {"name": "X-Infrai-Timestamp", "in": "header", "required": False,
                     "description": "default name; Unix seconds, signed with the body",
                     "schema": {"type": "string"}}],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/PushDelivery"}}}},
                "responses": {
                    **_ok("acknowledged: the outcome is committed (or there was nothing "
                          "to do: a settled or unknown operation)",
                          {"$ref": "#/components/schemas/PushAck"}),
                    **_errors(400, 401, 404, 413, 429, 503)},
            },
        },
        "/healthz": {"get": {"security": [], "summary": "liveness",
                             "responses": _ok("alive", {"type": "object"})}},
        "/readyz": {"get": {"security": [], "summary": "readiness", "responses": {
            **_ok("ready", {"type": "object"}),
            "503": {"description": "not ready", "content": {"application/json": {
                "schema": {"type": "object"}}}}}}},
        "/metrics": {"get": {
            "security": [{}, {"metrics": []}, {"viewer": []}, {"operator": []}],
            "summary": "Prometheus metrics",
            "description": "Open unless service.metrics_token_env is set; then it needs the "
                           "metrics, viewer or operator token.",
            "responses": {
                "200": {"description": "metrics", "content": {"text/plain": {
                    "schema": {"type": "string"}}}},
                **_errors(401)}}},
    },
    "components": {
        "securitySchemes": {
            "operator": {"type": "http", "scheme": "bearer",
                         "description": "trigger.token_env: opens runs (recipient_ids too, "
                                        "with source.kind = 'inline'), resolves, retries, "
                                        "lifts a budget pause, reads"},
            "tick": {"type": "http", "scheme": "bearer",
                     "description": "trigger.tick_token_env: opens runs of schedule.name, "
                                    "without recipient_ids; nothing else"},
            "viewer": {"type": "http", "scheme": "bearer",
                       "description": "status.token_env: reads (and /metrics)"},
            "metrics": {"type": "http", "scheme": "bearer",
                        "description": "service.metrics_token_env: GET /metrics only"},
        },
        "schemas": {
            "Error": {"type": "object", "required": ["error"],
                      "properties": {"error": {"type": "string"}}},
            "Tick": {
                "type": "object", "additionalProperties": False,
                "properties": {
                    "schedule": {"type": "string", "minLength": 1, "maxLength": 100,
                                 "pattern": SCHEDULE_NAME},
                    "scheduled_for": {"oneOf": [{"type": "string", "format": "date-time"},
                                                {"type": "number", "minimum": 0,
                                                 "maximum": 253402300799}]},
                    "recipient_ids": {"type": "array", "maxItems": 10000,
                                      "items": {"type": "string", "minLength": 1,
                                                "maxLength": 256, "pattern": PRINTABLE}},
                },
            },
            "Opened": {
                "type": "object", "required": ["created", "run"],
                "properties": {"created": {"type": "boolean"},
                               "run": {"type": "object", "required": ["id", "state"],
                                       "properties": {"id": {"type": "string"},
                                                      "state": {"type": "string"},
                                                      "tick_key": {"type": "string"}}}},
            },
            "Run": {
                "type": "object",
                "required": ["id", "state", "tick_key", "schedule", "discovered", "created_at"],
                "properties": {
                    "id": {"type": "string"},
                    "state": {"type": "string", "enum": [s.value for s in RunState]},
                    "tick_key": {"type": "string"}, "schedule": {"type": "string"},
                    "scheduled_for": _NUM_OR_NULL, "source": _STR_OR_NULL,
                    "discovered": {"type": "integer"}, "scan": {"type": "object"},
                    "created_at": {"type": "number"}, "scan_finished_at": _NUM_OR_NULL,
                    "finished_at": _NUM_OR_NULL,
                    "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
                    "unfinished": {"type": "integer"}, "projected_finish": {"type": "number"},
                },
            },
            "Operation": {
                "type": "object",
                "required": ["id", "run_id", "recipient_id", "state", "attempts"],
                "properties": {
                    "id": {"type": "string"}, "run_id": {"type": "string"},
                    "recipient_id": {"type": "string"}, "state": _STATE,
                    "attempts": {"type": "integer"}, "reason": _STR_OR_NULL,
                    "created_at": {"type": "number"}, "updated_at": {"type": "number"},
                    "attempts_log": {"type": "array", "items": {"type": "object"}},
                    # The next page's attempts_after; null: this page is the last.
                    "attempts_next": _STR_OR_NULL,
                },
            },
            "Exclusion": {
                "type": "object",
                "required": ["recipient_id", "operation_id", "run_id", "state", "reason"],
                "properties": {
                    "recipient_id": {"type": "string"}, "operation_id": {"type": "string"},
                    "run_id": {"type": "string"},
                    "state": _STATE,
                    "reason": {"type": "string", "enum": sorted(set(REASONS.values()))},
                    "detail": _STR_OR_NULL, "updated_at": {"type": "number"},
                },
            },
            "ExclusionPage": {
                "type": "object", "required": ["schedule", "runs", "exclusions", "next_after"],
                "properties": {
                    "schedule": {"type": "string"},
                    "runs": {"type": "array", "items": {
                        "type": "object", "required": ["id", "state", "complete"],
                        "properties": {"id": {"type": "string"},
                                       "state": {"type": "string",
                                                 "enum": [s.value for s in RunState]},
                                       "scheduled_for": _NUM_OR_NULL,
                                       "complete": {"type": "boolean"},
                                       "digest_cutoff": _NUM_OR_NULL}}},
                    "exclusions": {"type": "array",
                                   "items": {"$ref": "#/components/schemas/Exclusion"}},
                    "next_after": {"type": ["string", "null"]},
                },
            },
            "OpPage": {
                "type": "object", "required": ["operations", "next_after"],
                "properties": {
                    "operations": {"type": "array",
                                   "items": {"$ref": "#/components/schemas/Operation"}},
                    "next_after": {"type": ["string", "null"]},
                },
            },
            "PushDelivery": {
                "type": "object", "required": ["message_id"],
                "properties": {
                    "message_id": {"type": "string", "minLength": 1, "maxLength": 500},
                    "payload": {"$ref": "#/components/schemas/PushPayload"},
                    "body": {"$ref": "#/components/schemas/PushPayload"},
                },
            },
            "PushPayload": {
                "type": "object", "required": ["run_id", "operation_id", "recipient_id"],
                "properties": {k: {"type": "string", "minLength": 1, "maxLength": 500}
                               for k in ("run_id", "operation_id", "recipient_id")},
            },
            "PushAck": {
                "type": "object", "required": ["ok", "message_id", "operation_id"],
                "properties": {"ok": {"type": "boolean"}, "message_id": {"type": "string"},
                               "operation_id": {"type": "string"},
                               "result": {"type": "string"}},
            },
            "Resume": {
                "type": "object", "additionalProperties": False,
                "required": ["by", "reason"],
                "properties": {
                    "by": {"type": "string", "minLength": 1, "maxLength": 500,
                           "pattern": PRINTABLE},
                    "reason": {"type": "string", "minLength": 1, "maxLength": 500,
                               "pattern": PRINTABLE},
                    "forget_limit": {"type": "boolean", "default": False},
                },
            },
            "OperatorAction": {
                "type": "object", "required": ["id", "at", "action", "by", "reason", "detail"],
                "properties": {"id": {"type": "integer"}, "at": {"type": "number"},
                               "action": {"type": "string"}, "by": {"type": "string"},
                               "reason": {"type": "string"}, "detail": {"type": "object"}},
            },
            "Budget": {
                "type": "object",
                "required": ["partner", "rate_per_second", "ceiling_per_second", "paused",
                             "paused_until", "held_for_seconds", "max_pause_seconds",
                             "quotas"],
                "properties": {
                    "partner": {"type": "string"},
                    "rate_per_second": {"type": "number"},
                    "ceiling_per_second": {"type": "number"},
                    "learnt_limit_per_second": _NUM_OR_NULL,
                    "announced_limit_per_second": _NUM_OR_NULL,
                    "strict_pacing": {"type": "boolean"},
                    "paused": {"type": "boolean"},
                    "paused_until": _NUM_OR_NULL,
                    "pause_reason": _STR_OR_NULL,
                    "held_for_seconds": {"type": "number", "minimum": 0},
                    "max_pause_seconds": {"type": "number"},
                    "resumed_at": _NUM_OR_NULL,
                    "quotas": {"type": "array", "items": {
                        "type": "object",
                        "required": ["name", "limit", "window_seconds", "remaining"],
                        "properties": {"name": {"type": "string"},
                                       "limit": {"type": "integer"},
                                       "window_seconds": {"type": "number"},
                                       "remaining": {"type": "integer"},
                                       "resets_at": _NUM_OR_NULL}}},
                    "operator_actions": {"type": "array", "items": {
                        "$ref": "#/components/schemas/OperatorAction"}},
                },
            },
            "Resolution": {
                "type": "object", "additionalProperties": False,
                "required": ["outcome", "by", "reason"],
                "properties": {
                    "outcome": {"type": "string",
                                "enum": ["deleted", "already_absent", "failed", "retry"]},
                    "by": {"type": "string", "minLength": 1, "maxLength": 500,
                           "pattern": PRINTABLE},
                    "reason": {"type": "string", "minLength": 1, "maxLength": 500,
                               "pattern": PRINTABLE},
                },
            },
        },
    },
}


@functools.cache
def document_for(source_kind: str) -> dict[str, Any]:
    """The document as this deployment answers it: a tick carries ``recipient_ids`` only
    when the source is inline (elsewhere they are refused with a 400)."""
    if source_kind == "inline":
        return DOCUMENT
    doc = copy.deepcopy(DOCUMENT)
    del doc["components"]["schemas"]["Tick"]["properties"]["recipient_ids"]
    return doc
