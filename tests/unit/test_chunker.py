"""The chunker's rule (supervisor/batch/chunker.py): a batch leaves at K ids, before the
byte cap, or a linger after its first id, whichever comes first; partitions never mix; a
recipient never appears twice in one batch; K follows what the partner teaches."""

from __future__ import annotations

import asyncio

from supervisor.batch.chunker import Chunker, id_bytes
from supervisor.batchsettings import BatchConfig


def _chunker(linger: bool = True,
             **kw: object) -> tuple[Chunker[str], list[list[str]], asyncio.Event]:
    formed: list[list[str]] = []
    left = asyncio.Event()

    def flush(items: list[str]) -> None:
        formed.append(items)
        left.set()

    cfg = BatchConfig(**{"shape": "per_item", "max_items": 3, "linger_seconds": 3600.0,
                         **kw})  # type: ignore[arg-type]
    return Chunker(cfg, flush, lambda rid: rid, linger=linger), formed, left


async def test_a_full_batch_leaves_at_once_and_the_rest_waits() -> None:
    chunker, formed, _ = _chunker()
    for rid in ["a", "b", "c", "d"]:
        chunker.add(rid)
    assert formed == [["a", "b", "c"]]
    assert chunker.pending == 1


async def test_a_partial_batch_leaves_after_its_linger() -> None:
    chunker, formed, left = _chunker(linger_seconds=0.01)
    chunker.add("a")
    chunker.add("b")
    await asyncio.wait_for(left.wait(), 5)
    assert formed == [["a", "b"]]
    assert chunker.pending == 0


async def test_the_byte_cap_closes_a_batch_before_it_is_passed() -> None:
    long = "x" * 40
    cap = 32 + 2 * id_bytes(long)  # the envelope and two ids fit, a third would not
    chunker, formed, _ = _chunker(max_items=10, max_bytes=cap)
    for i in range(3):
        chunker.add(f"{long[:-1]}{i}")
    assert [len(b) for b in formed] == [2]


async def test_partitions_never_share_a_batch() -> None:
    chunker, formed, _ = _chunker(partition_pattern=r"^(\w+):")
    for rid in ["email:a", "phone:b", "email:c", "phone:d", "email:e"]:
        chunker.add(rid)
    assert formed == [["email:a", "email:c", "email:e"]]
    chunker.flush_all()
    assert formed[1] == ["phone:b", "phone:d"]


async def test_one_recipient_twice_goes_in_the_next_batch() -> None:
    chunker, formed, _ = _chunker()
    for rid in ["a", "b", "a"]:
        chunker.add(rid)
    assert formed == [["a", "b"]]
    chunker.flush_all()
    assert formed[1] == ["a"]


async def test_k_learns_the_cap_from_413_and_halves_on_429_only_from_a_limit_on_ids() -> None:
    chunker, _, _ = _chunker(max_items=100)
    chunker.refused_too_large(100)
    assert (chunker.cap, chunker.k) == (50, 50)
    chunker.throttled(ids=False)  # a limit on requests: fewer ids would not help
    assert chunker.k == 50
    items, _, _ = _chunker(max_items=100, cost="items")
    items.throttled(ids=True)
    items.throttled(ids=True)
    assert items.k == 25
    for _ in range(20):
        items.answered()
    assert items.k == 100  # grows back, never past the cap
    chunker.answered()
    assert chunker.k == 50  # the cap the partner taught is kept


async def test_dropped_batches_are_never_sent() -> None:
    chunker, formed, left = _chunker(linger_seconds=0.01)
    chunker.add("a")
    chunker.drop_all()
    assert chunker.pending == 0
    # A batch begun after the drop leaves at its linger, later than the dropped one's
    # would have: by then the dropped one has had every chance to leave, and did not.
    chunker.add("b")
    await asyncio.wait_for(left.wait(), 5)
    assert formed == [["b"]]


async def test_a_job_partners_partial_batch_waits_to_be_sent_oldest_first() -> None:
    chunker, formed, _ = _chunker(linger=False, partition_pattern=r"^(\w+):",
                                  linger_seconds=0.0)
    for rid in ["x:1", "y:2", "x:3"]:
        chunker.add(rid)
    assert formed == []
    assert chunker.flush_oldest()
    assert formed == [["x:1", "x:3"]]
    assert chunker.flush_oldest()
    assert not chunker.flush_oldest()
    assert formed[1] == ["y:2"]
