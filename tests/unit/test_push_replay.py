"""The push replay cache and the signature schemes it depends on: what a copy of a verified
delivery is answered, how long it is remembered, how the memory is bounded; and the
unsigned-timestamp ``body`` scheme refused unless explicitly allowed."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from supervisor import config
from supervisor.configtypes import Secret
from supervisor.errors import ConfigError
from supervisor.infrai.push import push_settings
from supervisor.push import PushOutcome, PushSettings, ReplayCache, parse_delivery, verify

SECRET = "push-secret-for-tests"
BODY = (b'{"message_id": "m-1", "payload": {"run_id": "run_1", "operation_id": "op_1",'
        b' "recipient_id": "r-1"}}')
NOW = 1_750_000_000.0
ENV = {"CLEANUP_TRIGGER_TOKEN": "trigger-secret-of-at-least-32-bytes!", "INFRAI_API_KEY": "ifr_key",
       "INFRAI_PUSH_SECRET": SECRET}


def evictions() -> float:
    return REGISTRY.get_sample_value("cleanup_push_replay_evictions_total") or 0.0


def mac(material: bytes) -> str:
    return hmac.new(SECRET.encode(), material, hashlib.sha256).hexdigest()


def test_a_signed_timestamp_is_remembered_until_its_signature_expires() -> None:
    settings = PushSettings(secret=Secret(SECRET))
    stamp = NOW - 100
    proof = verify(settings, {"X-Infrai-Signature": mac(f"{stamp:.0f}.".encode() + BODY),
                              "X-Infrai-Timestamp": f"{stamp:.0f}"}, BODY, NOW)
    assert proof.valid_until == stamp + 300  # then it is refused as stale anyway
    # However the header spells it, the proof is the one digest.
    upper = verify(settings, {"X-Infrai-Signature": "SHA256=" + proof.digest.upper(),
                              "X-Infrai-Timestamp": f"{stamp:.0f}"}, BODY, NOW)
    assert upper == proof


def test_the_body_scheme_is_remembered_for_the_tolerance_from_now() -> None:
    settings = PushSettings(secret=Secret(SECRET), scheme="body")
    proof = verify(settings, {"X-Infrai-Signature": mac(BODY)}, BODY, NOW)
    assert proof.valid_until == NOW + 300
    # An unsigned timestamp changes nothing: a copy may carry any, or none.
    stamped = verify(settings, {"X-Infrai-Signature": mac(BODY),
                                "X-Infrai-Timestamp": f"{NOW - 200:.0f}"}, BODY, NOW)
    assert stamped.digest == proof.digest


def test_answers_for_copies() -> None:
    cache = ReplayCache(10)
    delivery = parse_delivery(BODY)
    settings = PushSettings(secret=Secret(SECRET), scheme="body")
    proof = verify(settings, {"X-Infrai-Signature": mac(BODY)}, BODY, NOW)
    key = cache.key(delivery, proof)
    assert cache.answer(key, NOW) is None  # never seen
    seen = cache.begin(key, proof.valid_until)
    busy = cache.answer(key, NOW + 1)
    assert busy is not None
    assert (busy.status, busy.result) == (503, "replayed")
    # Told to come back in 30 s: a copy 10 s later is told 20 s, one at 30 s is worked.
    cache.done(key, seen, PushOutcome(503, "retry wait", 30.0, "retry"), NOW)
    later = cache.answer(key, NOW + 10)
    assert later is not None
    assert (later.status, later.retry_after_s, later.result) == (503, 20.0, "replayed")
    assert cache.answer(key, NOW + 30) is None
    assert len(cache) == 0
    # An answer that wrote nothing is not remembered: a copy is worked afresh.
    seen = cache.begin(key, proof.valid_until)
    cache.done(key, seen, PushOutcome(429, "held", 5.0, "held"), NOW)
    assert cache.answer(key, NOW) is None
    # Acked: every copy is the same 200 until the signature expires.
    seen = cache.begin(key, proof.valid_until)
    cache.done(key, seen, PushOutcome(200, "acked"), NOW)
    ok = cache.answer(key, NOW + 299)
    assert ok is not None
    assert (ok.status, ok.result) == (200, "replayed")
    assert cache.answer(key, NOW + 300) is None
    assert len(cache) == 0  # swept


def test_the_cache_is_bounded_and_counts_what_it_forgets() -> None:
    cache = ReplayCache(100)
    settings = PushSettings(secret=Secret(SECRET), scheme="body")
    before = evictions()
    keys = []
    for i in range(250):
        body = BODY.replace(b"m-1", f"m-{i}".encode())
        proof = verify(settings, {"X-Infrai-Signature": mac(body)}, body, NOW)
        key = cache.key(parse_delivery(body), proof)
        keys.append(key)
        cache.done(key, cache.begin(key, proof.valid_until), PushOutcome(200, "acked"), NOW)
        assert len(cache) <= 100
    assert len(cache) == 100
    assert evictions() - before == 150
    assert cache.answer(keys[0], NOW) is None  # the oldest went first
    assert cache.answer(keys[-1], NOW) is not None


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    return path


PUSH = '[queue]\nbackend = "infrai"\n[infrai]\ndelivery = "push"\n'


def test_the_body_scheme_is_refused_without_the_flag(tmp_path: Path) -> None:
    path = write(tmp_path, PUSH + 'push_signature_scheme = "body"\n')
    with pytest.raises(ConfigError) as info:
        config.load(path, environ=ENV)
    [problem] = [p for p in info.value.problems if "push_signature_scheme" in p]
    assert "no replay protection" in problem
    assert "valid forever" in problem
    assert "infrai.allow_unsigned_timestamp = true" in problem


def test_the_body_scheme_is_accepted_with_the_flag(tmp_path: Path) -> None:
    path = write(tmp_path, PUSH + 'push_signature_scheme = "body"\n'
                                  "allow_unsigned_timestamp = true\n")
    cfg = config.load(path, environ=ENV)
    assert push_settings(cfg.infrai).scheme == "body"
    # The signed scheme needs no flag.
    assert config.load(write(tmp_path, PUSH), environ=ENV).infrai.allow_unsigned_timestamp \
        is False


def test_the_replay_cache_size_is_checked_and_passed_on(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        config.load(write(tmp_path, PUSH + "push_replay_cache_entries = 0\n"), environ=ENV)
    assert any("infrai.push_replay_cache_entries must be > 0" in p
               for p in info.value.problems), info.value.problems
    cfg = config.load(write(tmp_path, PUSH + "push_replay_cache_entries = 500\n"),
                      environ=ENV)
    assert push_settings(cfg.infrai).replay_cache_entries == 500
