"""Peer 1, "cron alone": one job pages the stale list, then deletes serially.

Written the way the source article's TypeScript ``deleteRecipient`` does it: one DELETE at
a time with a stable ``Idempotency-Key``, 404 counts as done, a 429 waits ``Retry-After``
(delay-seconds or HTTP-date, else an exponential backoff) and tries again, at most six
attempts per recipient; anything else fails that recipient and the loop goes on.
No pacing of its own: it learns the limit only from 429s.

Prints two JSON lines on stdout: ``{"event": "started", "t0": <monotonic>}`` when it
begins (before paging the list), and the result when it ends or its deadline passes.
The partner token is read from the environment variable named by ``--token-env``.
"""

from __future__ import annotations

import argparse
import email.utils
import json
import os
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import requests

MAX_ATTEMPTS = 6


def peak_rss_kb() -> int:
    """VmHWM of this process. Not ru_maxrss: Linux carries the forking parent's peak
    across exec into it, so a child of a big harness would report the harness's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def retry_delay_s(response: requests.Response, attempt: int) -> float:
    value = response.headers.get("Retry-After")
    if value:
        try:
            return max(0.0, float(value))
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError, IndexError):
                when = None
            if when is not None:
                return max(0.0, when.timestamp() - time.time())
    return min(1.0 * 2**attempt, 30.0)


def list_stale(session: requests.Session, base_url: str) -> list[str]:
    ids: list[str] = []
    cursor: str | None = None
    while True:
        params = {"limit": "1000"}
        if cursor:
            params["cursor"] = cursor
        resp = session.get(f"{base_url}/stale-recipients", params=params, timeout=30)
        resp.raise_for_status()
        doc = resp.json()
        ids += [item["id"] for item in doc["items"]]
        cursor = doc.get("next_cursor")
        if not cursor:
            return ids


def delete_recipient(session: requests.Session, base_url: str, recipient_id: str,
                     operation_id: str, counters: dict[str, int]) -> bool:
    """True when the recipient is gone (deleted or already absent)."""
    url = f"{base_url}/recipients/{quote(recipient_id, safe='')}"
    for attempt in range(MAX_ATTEMPTS):
        resp = session.delete(url, headers={"Idempotency-Key": operation_id}, timeout=10)
        counters["requests"] += 1
        if resp.ok or resp.status_code == 404:
            return True
        if resp.status_code == 429 and attempt < MAX_ATTEMPTS - 1:
            counters["throttled"] += 1
            time.sleep(retry_delay_s(resp, attempt))
            continue
        return False
    return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-url", required=True)
    p.add_argument("--token-env", default="CUSTOMER_API_TOKEN")
    p.add_argument("--deadline-s", type=float, default=3600.0,
                   help="stop (and report what was done) after this long")
    args = p.parse_args()
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {os.environ[args.token_env]}"
    run_id = uuid.uuid4()
    t0 = time.monotonic()
    print(json.dumps({"event": "started", "t0": t0}), flush=True)
    counters = {"requests": 0, "throttled": 0}
    done = failed = 0
    ids = list_stale(session, args.base_url)
    listed_s = time.monotonic() - t0
    deadline = t0 + args.deadline_s
    for rid in ids:
        if time.monotonic() >= deadline:
            break
        operation_id = str(uuid.uuid5(run_id, rid))
        try:
            ok = delete_recipient(session, args.base_url, rid, operation_id, counters)
        except requests.RequestException:
            ok = False
        if ok:
            done += 1
        else:
            failed += 1
    t1 = time.monotonic()
    print(json.dumps({
        "event": "finished", "t0": t0, "t1": t1, "n": len(ids), "done": done,
        "failed": failed, "finished": done + failed == len(ids), "listed_s": listed_s,
        "maxrss_kb": peak_rss_kb(), "cpu_s": time.process_time(), **counters,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
