"""The batch wire contract (docs/batch.md): one request for many ids, read into what the
sender needs: the request's own answer, and each item's verdict where the partner gives
one. Nothing here decides what an answer makes of an operation; that is the sender's.

Like the single DELETE, the line that matters is between *transient* (the request never
left: nothing can have acted) and *ambiguous* (it left: anything may have)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson

from supervisor.batchsettings import BatchConfig
from supervisor.budget.base import Policy
from supervisor.httputil import parse_retry_after
from supervisor.partner import (
    Answer,
    PartnerClient,
    classify,
    no_answer,
    parse_policies,
)

# A per-item answer for 1,000 ids is ~50 KB; a job's results for 5,000 ids ~250 KB.
MAX_BATCH_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class BatchAnswer:
    """The request's own answer, and what its body said."""

    whole: Answer
    # Each item's HTTP-like status by recipient ID (per_item, or a finished job's
    # results); None when the body carries none (accepted, a job reference, an error).
    items: dict[str, int] | None = None
    job_ref: str | None = None
    # Why a 2xx body could not be read as the shape promised (None: it could).
    problem: str | None = None
    # Results for ids that were not sent (ignored, counted).
    strays: int = 0
    # The partner's own reason for an item it did not delete, where its verdict is not
    # a status (``item_verdict = "success"``): the code ``items`` maps onto a status.
    codes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class JobState:
    whole: Answer
    gone: bool = False  # 404/410: the job (and its results) expired
    done: bool = False
    status: str = ""
    progress: float | None = None
    expires_at: float | None = None
    items: dict[str, int] | None = None
    problem: str | None = None
    codes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Lookup:
    """A job found by our tag (``job_ref``), none found (``found`` False), or no answer
    (``known`` False: nothing can be concluded)."""

    known: bool
    found: bool = False
    job_ref: str | None = None
    detail: str = ""


@dataclass(slots=True)
class _Read:
    status: int
    body: bytes
    retry_after_s: float | None
    policies: tuple[Policy, ...]
    elapsed_s: float
    headers: Mapping[str, str] = field(default_factory=dict)


class BatchClient:
    """Sends batches, polls jobs and looks them up, on the partner client's session."""

    def __init__(self, partner: PartnerClient, config: BatchConfig) -> None:
        self.partner = partner
        self.config = config

    def _encoded(self, ids: Sequence[str]) -> str:
        return ",".join(quote(i, safe="") for i in ids)

    def request(self, ids: Sequence[str], batch_id: str) -> tuple[str, dict[str, Any], bytes | None]:
        """The path (with query), headers and body of one batch request."""
        c = self.config
        headers: dict[str, str] = {}
        if self.partner.config.idempotency_keys:
            headers["Idempotency-Key"] = batch_id
        path, body = c.path, None
        if c.ids_in == "path":
            path = path.replace("{ids}", self._encoded(ids))
        elif c.ids_in == "query":
            sep = "&" if "?" in path else "?"
            path = f"{path}{sep}{quote(c.ids_field, safe='')}={self._encoded(ids)}"
        if c.ids_in == "json" or c.shape == "job":
            doc: dict[str, Any] = {}
            if c.ids_in == "json":
                doc[c.ids_field] = list(ids)
            if c.shape == "job":
                doc[c.tag_field] = batch_id
            body = orjson.dumps(doc)
            headers["Content-Type"] = "application/json"
        return path, headers, body

    async def _call(self, method: str, path: str, headers: Mapping[str, str],
                    body: bytes | None) -> _Read | Answer:
        """The answer read, or an Answer saying why there is none."""
        started = time.monotonic()
        try:
            async with self.partner.session.request(
                    method, self.partner.url(path), headers=headers, data=body,
                    allow_redirects=False) as resp:
                data = await resp.content.read(MAX_BATCH_BODY_BYTES)
                now = time.time()
                maximum = self.partner.config.max_retry_after_seconds
                h = resp.headers
                retry_after = parse_retry_after(h.get("Retry-After"), now, maximum,
                                                self.partner.ignored)
                policies: tuple[Policy, ...] = ()
                if "RateLimit-Policy" in h or "X-RateLimit-Limit" in h:
                    policies = parse_policies(h, now, maximum, self.partner.ignored)
                return _Read(resp.status, data, retry_after, policies,
                             time.monotonic() - started, dict(h))
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return no_answer(exc, started)

    @staticmethod
    def _answer(read: _Read, what: str) -> Answer:
        detail = f"{what} HTTP {read.status}"
        if read.headers.get("Idempotent-Replayed", "").lower() == "true":
            detail += " (replayed)"
        return Answer(classify(read.status, read.retry_after_s), read.status, detail,
                      read.retry_after_s, read.elapsed_s, read.policies)

    async def send(self, ids: Sequence[str], batch_id: str) -> BatchAnswer:
        """One batch request; never raises for the partner's or the network's failures."""
        path, headers, body = self.request(ids, batch_id)
        read = await self._call(self.config.method, path, headers, body)
        if isinstance(read, Answer):
            return BatchAnswer(read)
        whole = self._answer(read, "batch")
        if not 200 <= read.status < 300:
            return BatchAnswer(whole)
        shape = self.config.shape
        if shape == "accepted":
            return BatchAnswer(whole)
        doc, problem = _json(read.body)
        if shape == "job":
            ref = doc.get(self.config.job_ref_field) if isinstance(doc, dict) else None
            if isinstance(ref, int | str) and not isinstance(ref, bool) and str(ref):
                return BatchAnswer(whole, job_ref=str(ref))
            return BatchAnswer(whole, problem=problem or
                               f"no {self.config.job_ref_field!r} in the answer")
        if problem is not None:
            return BatchAnswer(whole, problem=problem)
        got = self._results(doc, ids)
        return BatchAnswer(whole, items=got.items, problem=got.problem, strays=got.strays,
                           codes=got.codes)

    def _results(self, doc: Any, sent: Sequence[str]) -> _Results:
        """Each item's verdict, read as the HTTP status the sender understands. An item
        whose result cannot be read (or whose results disagree) has none, and the
        answer's ``problem`` says why: it is held ambiguous, never taken for a success."""
        c = self.config
        results = doc  # results_field "": the answer is the array (Salesforce's)
        if c.results_field:
            results = doc.get(c.results_field) if isinstance(doc, dict) else None
        if not isinstance(results, list):
            where = f"{c.results_field!r} array" if c.results_field else "array of results"
            return _Results(None, problem=f"no {where} in the answer")
        notes: list[str] = []
        strays = 0
        if c.item_order == "position":
            if len(results) != len(sent):
                return _Results({}, problem=f"{len(results)} results for {len(sent)} ids "
                                "sent: not matched by position; every item held ambiguous")
            pairs = list(zip(sent, results, strict=True))
            disorder = self._out_of_order(pairs)
            if disorder:
                return _Results({}, problem=disorder)
        else:
            pairs, strays = self._by_id(results, set(sent), notes)
        got: dict[str, list[tuple[int, str] | None]] = {}
        for rid, entry in pairs:
            verdict = None
            try:
                verdict = self._verdict(entry)
            except _Unreadable as exc:
                notes.append(f"the result for {rid!r}: {exc}")
            got.setdefault(rid, []).append(verdict)
        items: dict[str, int] = {}
        codes: dict[str, str] = {}
        for rid, verdicts in got.items():
            if len(verdicts) > 1:
                # Two verdicts for one id: the partner's truth is unknown unless they
                # agree, and a probe finds it out.
                agree = None not in verdicts and len(set(verdicts)) == 1
                notes.append(f"{len(verdicts)} results for {rid!r}"
                             + ("" if agree else " that disagree: it has none"))
                if not agree:
                    continue
            if verdicts[0] is not None:
                items[rid], code = verdicts[0]
                if code:
                    codes[rid] = code
        return _Results(items, codes, strays, _summary(notes))

    def _by_id(self, results: list[Any], wanted: set[str],
               notes: list[str]) -> tuple[list[tuple[str, Any]], int]:
        """The results naming an id sent, and how many named one that was not."""
        field_, pairs, strays = self.config.item_id_field, [], 0
        for i, entry in enumerate(results):
            rid = entry.get(field_) if isinstance(entry, dict) else None
            if not isinstance(rid, str):
                notes.append(f"result {i} has no {field_!r} string: {_brief(entry)}")
            elif rid not in wanted:
                strays += 1
            else:
                pairs.append((rid, entry))
        return pairs, strays

    def _out_of_order(self, pairs: list[tuple[str, Any]]) -> str | None:
        """Why results matched by position cannot be trusted: one names another id than
        the one sent in its place (a partner that leaves ids out may still give some)."""
        for i, (rid, entry) in enumerate(pairs):
            named = entry.get(self.config.item_id_field) if isinstance(entry, dict) else None
            if isinstance(named, str) and not _same_id(named, rid):
                return (f"result {i} names {named!r} where {rid!r} was sent: not in "
                        "request order; every item held ambiguous")
        return None

    def _verdict(self, entry: Any) -> tuple[int, str]:
        """One result's HTTP-like status, and the partner's code when it gave one."""
        c = self.config
        if not isinstance(entry, dict):
            raise _Unreadable(f"not an object: {_brief(entry)}")
        if c.item_verdict == "status":
            status = entry.get(c.item_status_field)
            if isinstance(status, bool) or not isinstance(status, int) \
                    or not 100 <= status <= 599:
                raise _Unreadable(f"{c.item_status_field!r} is not an HTTP status: "
                                  f"{_brief(status)}")
            return status, ""
        success = entry.get(c.item_success_field)
        if not isinstance(success, bool):
            raise _Unreadable(f"{c.item_success_field!r} is not a boolean: {_brief(success)}")
        if success:
            return 200, ""
        errors = entry.get(c.item_errors_field)
        if errors is None:
            errors = []
        if not isinstance(errors, list):
            raise _Unreadable(f"{c.item_errors_field!r} is not an array: {_brief(errors)}")
        found = []
        for error in errors:
            if not isinstance(error, dict):
                raise _Unreadable(f"{c.item_errors_field!r} holds a non-object: "
                                  f"{_brief(error)}")
            code = error.get(c.item_error_code_field)
            if not isinstance(code, str | None):
                raise _Unreadable(f"{c.item_error_code_field!r} is not a string: "
                                  f"{_brief(code)}")
            if code:
                found.append(code)
        # The first code decides (Salesforce lists an item's cause first); no code at all
        # is a failure nobody can explain, so not one to retry.
        code = found[0] if found else ""
        if code in c.absent_codes:
            return 404, code
        if code in c.retry_codes:
            return 503, code
        if code in c.throttled_codes:
            return 429, code
        return 422, code

    async def poll(self, job_ref: str) -> JobState:
        path = self.config.job_path.replace("{job_id}", quote(job_ref, safe=""))
        read = await self._call("GET", path, {}, None)
        if isinstance(read, Answer):
            return JobState(read)
        whole = self._answer(read, "job status")
        if read.status in (404, 410):
            return JobState(whole, gone=True)
        if not 200 <= read.status < 300:
            return JobState(whole)
        doc, problem = _json(read.body)
        if not isinstance(doc, dict):
            return JobState(whole, problem=problem or "the job status is not an object")
        c = self.config
        status = doc.get(c.job_status_field)
        status = status if isinstance(status, str) else ""
        progress = _finite(doc.get("progress"))
        expires = _finite(doc.get(c.job_expires_field))
        if status not in c.job_done_values:
            return JobState(whole, status=status, progress=progress, expires_at=expires)
        # A job's results are read by the ids they name: nothing here knows what was sent.
        got = self._results(doc, _result_ids(doc, c))
        return JobState(whole, done=True, status=status, progress=progress,
                        expires_at=expires, items=got.items, problem=got.problem,
                        codes=got.codes)

    async def lookup(self, batch_id: str) -> Lookup:
        """The job our batch ID tagged, found by the partner's listing."""
        if not self.config.job_lookup_path:
            return Lookup(known=False, detail="the partner has no job lookup")
        path = self.config.job_lookup_path.replace("{batch_id}", quote(batch_id, safe=""))
        read = await self._call("GET", path, {}, None)
        if isinstance(read, Answer):
            return Lookup(known=False, detail=read.detail)
        if not 200 <= read.status < 300:
            return Lookup(known=False, detail=f"lookup HTTP {read.status}")
        doc, problem = _json(read.body)
        jobs = doc.get("jobs") if isinstance(doc, dict) else None
        if not isinstance(jobs, list):
            return Lookup(known=False, detail=problem or "no 'jobs' array in the lookup")
        for job in jobs:
            if isinstance(job, dict) and job.get(self.config.tag_field) == batch_id:
                ref = job.get(self.config.job_ref_field)
                if isinstance(ref, int | str) and not isinstance(ref, bool) and str(ref):
                    return Lookup(known=True, found=True, job_ref=str(ref))
        return Lookup(known=True, found=False, detail="no job carries our tag")


def _json(body: bytes) -> tuple[Any, str | None]:
    try:
        return orjson.loads(body), None
    except orjson.JSONDecodeError:
        return None, "the answer is not JSON"


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _result_ids(doc: dict[str, Any], c: BatchConfig) -> list[str]:
    results = doc.get(c.results_field)
    if not isinstance(results, list):
        return []
    return [e[c.item_id_field] for e in results
            if isinstance(e, dict) and isinstance(e.get(c.item_id_field), str)]


class _Unreadable(ValueError):
    """A result whose verdict cannot be read: its item has no result."""


@dataclass(frozen=True, slots=True)
class _Results:
    items: dict[str, int] | None
    codes: dict[str, str] = field(default_factory=dict)
    strays: int = 0
    problem: str | None = None


def _summary(notes: list[str]) -> str | None:
    if not notes:
        return None
    more = f" (and {len(notes) - 3} more)" if len(notes) > 3 else ""
    return "; ".join(notes[:3]) + more


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _same_id(named: str, sent: str) -> bool:
    # Salesforce answers an id sent in its 15-character form with the 18-character one
    # (the same id and a 3-character case-safe suffix).
    return named == sent or (len(sent) == 15 and len(named) == 18 and named.startswith(sent))
