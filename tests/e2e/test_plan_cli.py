"""`cleanup-supervisor plan` as an operator runs it: counting the real source (the
partner simulator's paged endpoint, a JSONL file), and refusing bad input clearly."""

from __future__ import annotations

import orjson
import pytest

from tests.e2e.harness import toml_text

pytestmark = pytest.mark.e2e


async def test_plan_counts_the_http_source_and_judges_the_cutoff(e2e, tmp_path):
    sandbox = await e2e.sandbox("--recipients", 1234, "--rate", 500)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 2.0},
                                "schedule": {"digest_cutoff_seconds": 600}})
    code, out, err = await e2e.cli("plan", "--config", str(svc.config_path), "--count-source",
                                   "--start", "2026-12-07T02:00:00+00:00", "--json")
    assert code == 0, err
    doc = orjson.loads(out)
    assert doc["candidates"] == 1234  # 3 pages of 500
    assert doc["counted_pages"] == 3
    assert doc["rate"] == 2.0
    assert doc["ideal_seconds"] == 617.0
    assert doc["cron_alone_fits"] is False
    assert doc["fits_digest_cutoff"] is False  # 617 s x overhead > 600 s
    code, out, err = await e2e.cli("plan", "--config", str(svc.config_path), "--count-source",
                                   "--rate", "20")
    assert code == 0, err
    assert "N = 1,234 (counted from the source, 3 pages)" in out
    assert "cron alone       fits" in out


async def test_plan_counts_a_file_source_once_per_recipient(e2e, tmp_path):
    ids = tmp_path / "stale.jsonl"
    ids.write_text("".join(f'{{"id": "r-{i % 700}"}}\n' for i in range(1000)))  # 300 repeats
    cfg = tmp_path / "file.toml"
    cfg.write_text(toml_text({"source": {"kind": "file", "path": str(ids), "format": "jsonl"}}))
    code, out, err = await e2e.cli("plan", "--config", str(cfg), "--count-source", "--json")
    assert code == 0, err
    assert orjson.loads(out)["candidates"] == 700


async def test_plan_refuses_bad_input_naming_it(e2e, tmp_path):
    code, _, err = await e2e.cli("plan")
    assert code == 2
    assert "--candidates" in err
    code, _, err = await e2e.cli("plan", "--candidates", "-5")
    assert code == 2
    assert "must be a finite number > 0" in err
    code, _, err = await e2e.cli("plan", "--candidates", "10", "--start", "2026-12-07T02:00")
    assert code == 2
    assert "UTC offset" in err
    code, _, err = await e2e.cli("plan", "--candidates", "10", "--start", "monday")
    assert code == 2
    assert "ISO 8601" in err
    code, _, err = await e2e.cli("plan", "--count-source")  # the defaults: inline source
    assert code != 0
    assert "--candidates" in err
    # An http source that answers garbage: the scan's own error, no traceback.
    cfg = tmp_path / "bad.toml"
    cfg.write_text(toml_text({"source": {"kind": "http", "url": "http://127.0.0.1:9/x"}}))
    code, _, err = await e2e.cli("plan", "--config", str(cfg), "--count-source")
    assert code != 0
    assert "candidate source unreachable" in err
    assert "Traceback" not in err


async def test_plan_reads_a_config_without_its_secrets(e2e, tmp_path):
    # Arithmetic needs no token: a configuration whose secrets are not set still plans.
    cfg = tmp_path / "prod.toml"
    cfg.write_text(toml_text({"limits": {"rate_per_second": 20.0},
                              "schedule": {"digest_cutoff_seconds": 21600}}))
    env = {k: v for k, v in e2e.env.items() if not k.endswith("_TOKEN")}
    code, out, err = await e2e.cli("plan", "--config", str(cfg), "--candidates", "18400",
                                   "--json", env=env)
    assert code == 0, err
    doc = orjson.loads(out)
    assert (doc["rate"], doc["cutoff_s"], doc["fits_digest_cutoff"]) == (20.0, 21600, True)
    # serve still refuses the same file without the trigger token.
    code, _, err = await e2e.cli("check-config", str(cfg), env=env)
    assert code == 2
    assert "trigger.token_env" in err


async def test_plan_reads_the_batch_section_and_the_flags_override_it(e2e, tmp_path):
    # The article's Monday against a partner taking 100 ids a request, accepted whole.
    cfg = tmp_path / "batch.toml"
    cfg.write_text(toml_text({"limits": {"rate_per_second": 20.0},
                              "batch": {"shape": "accepted", "max_items": 100,
                                        "cost": "requests"}}))
    base = ("plan", "--config", str(cfg), "--candidates", "18400")
    code, out, err = await e2e.cli(*base, "--json")
    assert code == 0, err
    doc = orjson.loads(out)
    assert (doc["shape"], doc["batches"], doc["probes"], doc["requests"]) == (
        "accepted", 184, 18_400, 18_584)
    assert doc["ideal_seconds"] == pytest.approx((184 + 18_400) / 20)
    assert doc["batch"]["size"] == 100
    assert doc["cron_alone_fits"] is False
    code, out, err = await e2e.cli(*base)
    assert code == 0, err
    assert "shape            batch accepted: up to K = 100 ids a request" in out
    assert "about as much as one DELETE per recipient" in out
    # One result per id: 184 requests, 9.2 s, and cron alone fits.
    code, out, err = await e2e.cli(*base, "--batch-shape", "per_item", "--json")
    assert code == 0, err
    doc = orjson.loads(out)
    assert (doc["shape"], doc["requests"], doc["cron_alone_fits"]) == ("per_item", 184, True)
    assert doc["ideal_seconds"] == pytest.approx(9.2)
    # Charged per id: 920 s whatever the batch size.
    code, out, err = await e2e.cli(*base, "--batch-shape", "per_item", "--batch-cost", "items",
                                   "--batch-size", "500")
    assert code == 0, err
    assert "N / R            = 15 min 20 s (920 s)" in out
    assert "batches do not speed it up; they send 37 requests instead of 18,400" in out
    # Two limits: 20 requests and 500 ids a second; the ids bind (36.8 s). Without the
    # ids' limit, a usage error that names the flag.
    code, out, err = await e2e.cli(*base, "--batch-shape", "per_item", "--batch-cost", "both",
                                   "--items-rate", "500", "--json")
    assert code == 0, err
    assert orjson.loads(out)["ideal_seconds"] == pytest.approx(36.8)
    code, out, err = await e2e.cli(*base, "--batch-shape", "per_item", "--batch-cost", "both")
    assert code == 2, (code, err)
    assert "--items-rate" in err, err
    # Jobs: 4 in flight (the default), 60 s each.
    code, out, err = await e2e.cli(*base, "--batch-shape", "job", "--job-seconds", "60",
                                   "--json")
    assert code == 0, err
    doc = orjson.loads(out)
    assert (doc["job_waves"], doc["job_floor_seconds"], doc["least_seconds"]) == (46, 2760, 2760)
    assert doc["polls"] == 184 * 8
    # And back to one DELETE per recipient.
    code, out, err = await e2e.cli(*base, "--batch-shape", "single", "--json")
    assert code == 0, err
    doc = orjson.loads(out)
    assert (doc["shape"], doc["batch"], doc["ideal_seconds"]) == ("single", None, 920.0)


async def test_plan_refuses_batch_flags_it_would_ignore(e2e, tmp_path):
    code, _, err = await e2e.cli("plan", "--candidates", "10", "--batch-size", "50")
    assert code == 2
    assert "need a batch shape" in err
    code, _, err = await e2e.cli("plan", "--candidates", "10", "--batch-shape", "per_item",
                                 "--job-seconds", "60")
    assert code == 2
    assert "--job-seconds is for batch shape 'job'" in err
    code, _, err = await e2e.cli("plan", "--candidates", "10", "--batch-shape", "job",
                                 "--batch-size", "0")
    assert code == 2
    assert "must be a finite number > 0" in err
    code, _, err = await e2e.cli("plan", "--candidates", "10", "--batch-shape", "batched")
    assert code == 2
    assert "invalid choice" in err
