"""The clock at Infrai: ``infrai cron apply`` against the emulator's cron surface, and the
trigger webhook taking the emulator's scheduled POSTs (a late or retried tick opens one
run, keyed by the slot the expression names)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from croniter import croniter

from cleanup_sandbox.infrai import Emulator
from supervisor import config as config_module
from supervisor.configtypes import Secret
from supervisor.infrai.client import InfraiClient
from supervisor.infrai.cron import CronRefused, InfraiCron, check_expression
from supervisor.infrai.settings import InfraiConfig
from tests.helpers import infrai_config

from .http_app import TOKEN, running_api

TICK = "tick-token-of-the-cron-job-0123456789"


@pytest.fixture
def emulator_options() -> dict[str, Any]:
    return {"cron_allow_private_targets": True, "cron_poll_seconds": 0}


def infrai(emulator: Emulator, **overrides: Any) -> InfraiConfig:
    return infrai_config(emulator, **{"trigger_url": "https://cleanup.example.com/v1/runs",
                                      **overrides})


@pytest.fixture
async def client(emulator: Emulator) -> AsyncIterator[InfraiClient]:
    c = InfraiClient(infrai(emulator))
    await c.start()
    try:
        yield c
    finally:
        await c.close()


def cron_calls(emulator: Emulator) -> list[str]:
    return [str(c["capability"]) for c in emulator.calls if "cron" in str(c["capability"])]


async def test_apply_creates_once_and_replaces_on_change(emulator: Emulator,
                                                         client: InfraiClient) -> None:
    cron = InfraiCron(client, infrai(emulator), Secret(TOKEN))
    spec = cron.spec("weekly", "0 2 * * 1", "Europe/Berlin")
    done, job = await cron.apply(spec)
    assert done == "created"
    assert (job["schedule"], job["timezone"], job["url"], job["payload"]) == (
        "0 2 * * 1", "Europe/Berlin", "https://cleanup.example.com/v1/runs",
        {"schedule": "weekly"})
    assert job["cron_id"] == job["id"] == job["job_id"]
    again, same = await cron.apply(spec)
    assert (again, same["cron_id"]) == ("unchanged", job["cron_id"])
    assert cron_calls(emulator).count("cron.create") == 1  # applying twice changed nothing
    changed, new = await cron.apply(cron.spec("weekly", "30 2 * * 1", "Europe/Berlin"))
    assert changed == "replaced"
    jobs = await cron.jobs()
    assert [j["cron_id"] for j in jobs] == [new["cron_id"]]  # the old job is gone
    create = next(c for c in emulator.calls if c["capability"] == "cron.create")
    assert str(create["idempotency_key"]).startswith("cron-cleanup-weekly-")


async def test_the_scheduling_path_family_works_too(emulator: Emulator,
                                                    client: InfraiClient) -> None:
    cron = InfraiCron(client, infrai(emulator, cron_paths="scheduling"), None)
    done, _ = await cron.apply(cron.spec("weekly", "0 2 * * 1", "UTC"))
    assert done == "created"
    assert "scheduling.cron.create" in cron_calls(emulator)


@pytest.mark.parametrize("expr", ["0 2 L * *", "0 2 * * 1W", "0 2 * * 1#2", "0 2 ? * 1",
                                  "0 0 2 * * 1", "not cron at all x"])
async def test_expressions_infrai_cannot_run_are_refused_before_sending(
        emulator: Emulator, client: InfraiClient, expr: str) -> None:
    with pytest.raises(CronRefused, match=r"schedule\.cron"):
        check_expression(expr)
    cron = InfraiCron(client, infrai(emulator), None)
    with pytest.raises(CronRefused):
        cron.spec("weekly", expr, "UTC")
    assert cron_calls(emulator) == []


async def test_no_trigger_url_is_refused(emulator: Emulator, client: InfraiClient) -> None:
    cron = InfraiCron(client, infrai(emulator, trigger_url=""), None)
    with pytest.raises(CronRefused, match=r"infrai\.trigger_url"):
        cron.spec("weekly", "0 2 * * 1", "UTC")


async def test_infrais_ticks_open_one_run_per_slot(emulator: Emulator, tmp_path: Path) -> None:
    """Three of Infrai's POSTs (its run, a retry, an operator's "run now"), carrying the
    tick token: one slot, the one the weekly expression names for now, and one run."""
    cfg = config_module.load(None, environ={
        "CLEANUP_TRIGGER_TOKEN": TOKEN, "CLEANUP_TICK_TOKEN": TICK,
        "CLEANUP__SERVICE__DATA_DIR": str(tmp_path), "CLEANUP__SCHEDULE__CRON": "0 2 * * 1",
        "CLEANUP__SCHEDULE__CLOCK": "external", "CLEANUP__SOURCE__KIND": "file",
        "CLEANUP__SOURCE__PATH": str(tmp_path / "none.jsonl")})
    async with running_api(cfg) as api:
        url = str(api.client.make_url("/v1/runs"))
        client = InfraiClient(infrai(emulator, trigger_url=url))
        await client.start()
        try:
            cron = InfraiCron(client, infrai(emulator, trigger_url=url), cfg.trigger.tick_token)
            _, job = await cron.apply(cron.spec("weekly", "0 2 * * 1", "UTC"))
            # What anyone reading the project's cron jobs would find: the tick token only.
            stored = emulator.cron.model.get(str(job["cron_id"])).spec.headers
            assert stored == {"Authorization": f"Bearer {TICK}"}
            for _ in range(3):
                await client.call("cron.trigger", f"/v1/cron/trigger/{job['cron_id']}")
                emulator.cron.tick()
                await emulator.cron.drain()
            runs = await cron.runs(job)
        finally:
            await client.close()
        assert len(runs) == 3
        assert all(r["status"] == "succeeded" for r in runs), runs
        # Answered at once and far under the 4 KB Infrai keeps of a run's output.
        assert all(len(r["output"]) < 4096 and not r["output_truncated"] for r in runs), runs
        assert [r["http_status"] for r in runs] == [201, 200, 200], runs
        [run] = await api.ledger.list_runs(10)
        # The Monday 02:00 UTC at or before now (a weekly slot is never 30 s away here).
        now = datetime.now(UTC)
        monday = croniter("0 2 * * 1", now).get_prev(datetime)
        assert run.tick_key == f"weekly@{monday.isoformat()}"


async def test_replacing_keeps_the_job_it_just_created(emulator: Emulator,
                                                      client: InfraiClient) -> None:
    """A forced replace whose create is replayed by its key (the same spec) must not
    delete the very job it names."""
    cron = InfraiCron(client, infrai(emulator), Secret(TOKEN))
    spec = cron.spec("weekly", "0 2 * * 1", "UTC")
    _, job = await cron.apply(spec)
    done, again = await cron.apply(spec, replace=True)
    assert again["cron_id"] == job["cron_id"]
    assert [j["cron_id"] for j in await cron.jobs()] == [job["cron_id"]], done


def test_month_and_weekday_names_are_no_extended_syntax() -> None:
    check_expression("0 2 * * WED")
    check_expression("0 2 * JUL mon-fri")
    with pytest.raises(CronRefused):
        check_expression("0 2 * * 5L")
