"""Where the bench machinery lives now (this module only re-exports it, for old imports).

* ``paths``: where the bench reads and writes, the interpreter, the peers' Redis;
* ``matrix``: the partner cells (Cell, CELLS, DEFAULT_CELL) and worst/best cell;
* ``scenario``: Event, Target, Scenario, Result, the ideal/ratio maths, follow delays,
  targets;
* ``processes``: the partner simulator, the service process, /metrics, /proc, the
  service's TOML config;
* ``drivers``: one run of each tool (service, cron, celery) into a Result;
* ``runner``: a tool on a cell, a scenario over the matrix, then the peers;
* ``report``: tables, preamble, save and load;
* ``scenarios``: the scenario definitions and the scripts' shared command line.
"""

from __future__ import annotations

from drivers import claim_redis_db, have_tool, run_celery, run_cron, run_service
from matrix import CELLS, DEFAULT_CELL, Cell
from paths import BENCH, LOGS, OUT, PY, REDIS_URL, REPO, TOOLS
from processes import (
    Partner,
    clean_env,
    cpu_s,
    dump_toml,
    free_port,
    host_busy_cpu_s,
    parse_overrides,
    sandbox,
    service_config,
    stop_process,
    vm_hwm_mb,
)
from report import describe, environment, load_results, preamble, save, table, tables
from runner import run_tool
from scenario import Event, Result, Scenario, Target, follow_delays

__all__ = [
    "BENCH", "CELLS", "DEFAULT_CELL", "LOGS", "OUT", "PY", "REDIS_URL", "REPO", "TOOLS",
    "Cell", "Event", "Partner", "Result", "Scenario", "Target", "claim_redis_db",
    "clean_env", "cpu_s", "describe", "dump_toml", "environment", "follow_delays",
    "free_port", "have_tool", "host_busy_cpu_s", "load_results", "parse_overrides",
    "preamble", "run_celery", "run_cron", "run_service", "run_tool", "sandbox", "save",
    "service_config", "stop_process", "table", "tables", "vm_hwm_mb",
]
