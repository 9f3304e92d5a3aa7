"""The ``[batch]`` section: how a partner that deletes many recipients per request is
called, what its answer looks like, and which unit its limit counts (docs/batch.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from supervisor.configtypes import _positive

Shape = Literal["", "per_item", "accepted", "job"]
Cost = Literal["requests", "items", "both"]


@dataclass(frozen=True, slots=True)
class BatchConfig:
    # "" (the default): one DELETE per recipient. "per_item": one verdict per id in the
    # answer (Salesforce Collections, Graph $batch, Firebase, Box). "accepted": accepted
    # whole, nothing per id (HubSpot 204, Braze, SendGrid 202): every id is probed.
    # "job": a job submitted, then polled for its per-id results (Mailchimp, Zendesk,
    # Segment, Salesforce Bulk).
    shape: Shape = ""
    method: Literal["POST", "DELETE", "PUT"] = "POST"
    path: str = "/recipients/batch-delete"
    # Where the ids go: a JSON array under ``ids_field``; a comma list in the query
    # parameter ``ids_field``; or comma-joined into ``{ids}`` in the path.
    ids_in: Literal["json", "query", "path"] = "json"
    ids_field: str = "ids"
    max_items: int = 100
    # The most bytes of ids (JSON array or comma list) one request may carry.
    max_bytes: int = 65536
    # A batch leaves when it is full, at the byte cap, or this long after its first id.
    linger_seconds: float = 0.05
    # Ids that may not share a batch (Braze: one identifier type per request): a regular
    # expression whose first group (else whole match) of the recipient ID is the key; ""
    # puts every id in one partition.
    partition_pattern: str = ""
    # What the partner's limit counts: every request ("requests": a batch costs one
    # token of [limits]) or every id ("items": [limits].rate_per_second is ids per
    # second, and a batch of k costs k), or both as two limits ("both": a batch takes one
    # token of [limits] and k of a second budget at ``items_per_second``; a 429 adapts
    # the one it implicates: supervisor/budget/pair.py).
    cost: Cost = "requests"
    # "both" only: the partner's limit on ids per second.
    items_per_second: float = 0.0
    # The answer: the array of per-id results ("": the answer is the array itself, as
    # Salesforce's sObject Collections answers), and each result's fields.
    results_field: str = "results"
    item_id_field: str = "id"
    # How a result is matched to the id it answers: by its ``item_id_field`` ("id"), or
    # the i-th result to the i-th id sent ("position": Salesforce answers in request
    # order and leaves the id out of some failures). "position" needs exactly one result
    # per id sent; any other count holds every item ambiguous.
    item_order: Literal["id", "position"] = "id"
    # What a result's verdict is: an HTTP status code in ``item_status_field`` ("status":
    # Graph, Box, Google's parts; 2xx deleted, 404/410 already absent, 429 throttled,
    # 408/409/5xx retryable, any other permanent), or a boolean in ``item_success_field``
    # with, when false, an array of error objects in ``item_errors_field`` whose first
    # ``item_error_code_field`` says why ("success": Salesforce's DeleteResult).
    item_verdict: Literal["status", "success"] = "status"
    item_status_field: str = "status"
    item_success_field: str = "success"
    item_errors_field: str = "errors"
    item_error_code_field: str = "statusCode"
    # "success" only: an unsuccessful item's code read as already absent (done, as a
    # 404), retryable (as a 503), or throttled on its own (as an item's 429); any other
    # code, or none, fails it permanently (as a 422). The defaults are Salesforce's
    # StatusCode values: a record already deleted; a row lock or an outage;
    # allOrNone's rollback of the items that did not fail themselves; the org's limit.
    absent_codes: tuple[str, ...] = ("ENTITY_IS_DELETED", "NOT_FOUND")
    retry_codes: tuple[str, ...] = ("UNABLE_TO_LOCK_ROW", "SERVER_UNAVAILABLE",
                                    "ALL_OR_NONE_OPERATION_ROLLED_BACK")
    throttled_codes: tuple[str, ...] = ("REQUEST_LIMIT_EXCEEDED",)
    # "accepted" partners: confirm each id with a probe (partner.probe_path). Settling
    # them unprobed trusts that an accepted batch deleted every id, which HubSpot's 204
    # ("regardless of the initial state") does not promise: silent misses go unseen.
    settle_accepted_unprobed_risking_silent_misses: bool = False
    # Probe an accepted batch's ids this long after the answer (a partner that applies
    # the deletion asynchronously needs a moment).
    probe_delay_seconds: float = 0.0
    # "job" partners: the job reference in the submission's answer, where its status is
    # read, the status field and its values, when its results expire, and where a job is
    # looked up by our batch ID (sent under ``tag_field``) after a submission whose
    # answer was lost ("" when the partner has no such lookup: its items are probed).
    job_ref_field: str = "job_id"
    job_path: str = "/recipients/batch-jobs/{job_id}"
    job_status_field: str = "status"
    job_done_values: tuple[str, ...] = ("finished", "partial_success", "failed")
    job_expires_field: str = "expires_at"
    job_lookup_path: str = "/recipients/batch-jobs?tag={batch_id}"
    tag_field: str = "tag"
    # Jobs submitted and not finished, per partner (shared by replicas).
    max_jobs_in_flight: int = 4
    poll_initial_seconds: float = 0.5
    poll_max_seconds: float = 30.0
    # A job still unfinished this long after its submission pages
    # (CleanupBatchJobOverdue); it is still polled (its results are what settles it).
    job_deadline_seconds: float = 3600.0

    @property
    def enabled(self) -> bool:
        return self.shape != ""

    def problems(self) -> list[str]:
        out = _positive("batch", self, "max_items", "max_bytes", "max_jobs_in_flight",
                        "poll_initial_seconds", "poll_max_seconds", "job_deadline_seconds")
        for key in ("linger_seconds", "probe_delay_seconds"):
            if not getattr(self, key) >= 0:
                out.append(f"batch.{key} must be >= 0, got {getattr(self, key)}")
        if self.ids_in == "path" and "{ids}" not in self.path:
            out.append(f"batch.path must contain {{ids}} when batch.ids_in = 'path', "
                       f"got {self.path!r}")
        if self.shape == "job" and "{job_id}" not in self.job_path:
            out.append(f"batch.job_path must contain {{job_id}}, got {self.job_path!r}")
        if self.job_lookup_path and "{batch_id}" not in self.job_lookup_path:
            out.append(f"batch.job_lookup_path must contain {{batch_id}} (or be \"\"), "
                       f"got {self.job_lookup_path!r}")
        if self.partition_pattern:
            try:
                re.compile(self.partition_pattern)
            except re.error as exc:
                out.append(f"batch.partition_pattern is not a regular expression: {exc}")
        if self.cost == "both" and not self.items_per_second > 0:
            out.append("batch.items_per_second must be > 0 when batch.cost = 'both', "
                       f"got {self.items_per_second}")
        elif self.cost != "both" and self.items_per_second:
            out.append(f"batch.items_per_second is read only when batch.cost = 'both' "
                       f"(batch.cost = {self.cost!r}); remove it or set batch.cost")
        if self.poll_max_seconds < self.poll_initial_seconds:
            out.append("batch.poll_max_seconds must be >= batch.poll_initial_seconds")
        return out + self._verdict_problems()

    def _verdict_problems(self) -> list[str]:
        out: list[str] = []
        fields = ["item_success_field", "item_errors_field", "item_error_code_field"] \
            if self.item_verdict == "success" else ["item_status_field"]
        if self.item_order == "id":
            fields.insert(0, "item_id_field")
        for key in fields:
            if not getattr(self, key):
                out.append(f"batch.{key} must not be empty (batch.item_verdict = "
                           f"{self.item_verdict!r}, batch.item_order = {self.item_order!r})")
        if self.shape == "job" and not self.results_field:
            out.append("batch.results_field must name the job status's array of results "
                       "(batch.shape = 'job')")
        if self.item_order == "position" and self.shape == "job":
            # The poller reads a finished job's results without the ids it sent.
            out.append("batch.item_order = 'position' is not supported with batch.shape = "
                       "'job': a job's results must carry their ids (batch.item_order = 'id')")
        named: dict[str, str] = {}
        for key in ("absent_codes", "retry_codes", "throttled_codes"):
            for code in getattr(self, key):
                if not code:
                    out.append(f"batch.{key} holds an empty code")
                elif code in named:
                    out.append(f"batch.{key} and batch.{named[code]} both hold {code!r}: "
                               "an item's code must mean one thing")
                else:
                    named[code] = key
        return out
