"""``infrai push subscribe``: register this service's push endpoint for the queue.

``POST /v1/queue/push_subscribe/{queue}`` (infrai-api.md 3.1, third-party evidence only)
with ``url``, ``queue``, ``secret``, ``visibility_timeout``, ``max_retries``,
``dead_letter_queue`` and an idempotency key derived from all of them, so subscribing
twice within Infrai's dedup window creates one subscription. The answer's ``{id}`` is the
subscription ID. Infrai delivers only to public HTTPS URLs (a private one is accepted and
then receives nothing), so such a URL is refused before anything is sent.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

import orjson

from supervisor.configtypes import Secret, missing_secret
from supervisor.errors import CleanupError
from supervisor.infrai.client import InfraiClient, InfraiError
from supervisor.infrai.settings import InfraiConfig
from supervisor.push import PushSettings


class SubscribeRefused(CleanupError):
    """A subscription Infrai could not deliver to as configured: refused before sending."""


def push_settings(c: InfraiConfig) -> PushSettings:
    """The receiver's settings from ``[infrai]`` (the route needs the secret)."""
    if c.push_secret is None:
        raise SubscribeRefused(missing_secret("infrai.push_secret_env", c.push_secret_env,
                                              "pushed deliveries are verified with it"))
    return PushSettings(secret=c.push_secret, signature_header=c.push_signature_header,
                        signature_prefix=c.push_signature_prefix,
                        timestamp_header=c.push_timestamp_header,
                        scheme=c.push_signature_scheme,
                        timestamp_tolerance_s=c.push_timestamp_tolerance_seconds,
                        visibility_timeout_s=float(c.push_visibility_timeout),
                        max_wait_s=c.push_max_wait_seconds,
                        replay_cache_entries=c.push_replay_cache_entries)


@dataclass(frozen=True, slots=True)
class Subscription:
    queue: str
    url: str
    visibility_timeout: int
    max_retries: int
    dead_letter_queue: str  # "" for none
    secret: Secret = field(repr=False, compare=False)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"url": self.url, "queue": self.queue,
                                "secret": self.secret.reveal(),
                                "visibility_timeout": self.visibility_timeout,
                                "max_retries": self.max_retries}
        if self.dead_letter_queue:
            body["dead_letter_queue"] = self.dead_letter_queue
        return body

    def key(self) -> str:
        """Names this exact subscription, the secret included (without showing it)."""
        fields = {"queue": self.queue, "url": self.url, "dlq": self.dead_letter_queue,
                  "visibility_timeout": self.visibility_timeout,
                  "max_retries": self.max_retries}
        digest = hashlib.sha256(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS) + b"\0"
                                + self.secret.reveal().encode()).hexdigest()[:16]
        return f"push-{self.queue}-{digest}"


def subscription(c: InfraiConfig, allow_private: bool = False) -> Subscription:
    """The subscription ``[infrai]`` describes; SubscribeRefused if Infrai could not
    deliver to it. ``allow_private``: for an emulator on loopback."""
    if not c.push_url:
        raise SubscribeRefused("infrai.push_url is not set: the public HTTPS URL of this "
                               f"service's /v1/push/{c.queue}, which Infrai POSTs to")
    url = c.push_url.replace("{queue}", quote(c.queue, safe=""))
    check_url(url, c.queue, allow_private)
    secret = push_settings(c).secret
    return Subscription(queue=c.queue, url=url, visibility_timeout=c.push_visibility_timeout,
                        max_retries=c.max_retries, dead_letter_queue=c.dlq, secret=secret)


def check_url(url: str, queue: str, allow_private: bool = False) -> None:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme != "https" and not allow_private:
        raise SubscribeRefused(f"infrai.push_url {url!r} is not https: Infrai delivers only "
                               "to public HTTPS URLs")
    if parts.scheme not in ("http", "https") or not host:
        raise SubscribeRefused(f"infrai.push_url {url!r} is not an http(s) URL")
    if not allow_private and (host == "localhost" or host.endswith(".localhost")
                              or _private(host)):
        raise SubscribeRefused(f"infrai.push_url {url!r} names a private or loopback host: "
                               "Infrai would accept the subscription and deliver nothing")
    if not parts.path.rstrip("/").endswith(f"/v1/push/{quote(queue, safe='')}"):
        raise SubscribeRefused(f"infrai.push_url {url!r} must end with /v1/push/"
                               f"{quote(queue, safe='')} (the route that takes this queue's "
                               "deliveries; {queue} is replaced by the queue name)")


def _private(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False  # a name: not resolved here
    return not address.is_global


async def subscribe(client: InfraiClient, sub: Subscription) -> dict[str, Any]:
    """Register ``sub``; return its ID, queue and URL (never the secret)."""
    path = f"/v1/queue/push_subscribe/{quote(sub.queue, safe='')}"
    body = sub.body()
    key = sub.key()
    try:
        data = await client.call("queue.push_subscribe", path, body, idempotency_key=key)
    except InfraiError as exc:
        if exc.status != 400:
            raise
        # Most clients name the target "url", one article "endpoint": try that once.
        alt = {("endpoint" if k == "url" else k): v for k, v in body.items()}
        data = await client.call("queue.push_subscribe", path, alt, idempotency_key=key + "-e")
    found = data.get("id", data.get("subscription_id")) if isinstance(data, dict) else None
    # Typed clients read {id}; one sample reads only .queue: an answer without an ID is
    # still a subscription (ok: true), shown with id null.
    sub_id = str(found) if isinstance(found, str | int) and not isinstance(found, bool) \
        and str(found) else None
    queue = data.get("queue", sub.queue) if isinstance(data, dict) else sub.queue
    return {"id": sub_id, "queue": queue if isinstance(queue, str) else sub.queue,
            "url": sub.url, "visibility_timeout": sub.visibility_timeout,
            "max_retries": sub.max_retries, "dead_letter_queue": sub.dead_letter_queue or None}
