"""Every SQL statement of the embedded (SQLite) ledger and queue, by name.

Keeping them here makes the schema and the state changes reviewable in one file. The
ledger's statements (:class:`~supervisor.ledger.driver.Statements`) number their
parameters (``?1``) as supervisor/postgres/sql.py does (``$1``): the ledger's core passes
the same arguments to both.
"""

from __future__ import annotations

from supervisor.ledger import shape
from supervisor.states import OpState

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    tick_key TEXT NOT NULL UNIQUE,          -- schedule name + scheduled slot: a repeated tick dedupes here
    schedule TEXT NOT NULL,
    scheduled_for REAL,
    state TEXT NOT NULL,
    source TEXT NOT NULL,                   -- JSON: kind and, for inline runs, the IDs
    source_kind TEXT,                       -- source's kind: what list reads show, without the JSON
    scan_cursor TEXT,                       -- the last committed page's cursor: the scan resumes here
    scan_pages INTEGER NOT NULL DEFAULT 0,
    discovered INTEGER NOT NULL DEFAULT 0,
    skipped_candidates INTEGER NOT NULL DEFAULT 0,
    scan_failures INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    created_at REAL NOT NULL,
    scan_finished_at REAL,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS runs_state ON runs(state);
CREATE INDEX IF NOT EXISTS runs_created ON runs(created_at, id);
-- Exclusions read a schedule's newest run and its unfinished ones, not every run ever.
CREATE INDEX IF NOT EXISTS runs_schedule ON runs(schedule, created_at, id);
CREATE INDEX IF NOT EXISTS runs_schedule_unfinished ON runs(schedule, created_at, id)
    WHERE state != 'done';

CREATE TABLE IF NOT EXISTS operations (
    id TEXT PRIMARY KEY,                    -- assigned once at discovery; the Idempotency-Key
    run_id TEXT NOT NULL REFERENCES runs(id),
    recipient_id TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    reason TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    owner TEXT,                             -- the lease holding the attempt in flight
    busy_until REAL,                        -- no other worker may start an attempt before
    -- The transport's bookkeeping, kept here because a managed queue does not give it:
    message_id TEXT,                        -- the live message; NULL: none is out there
    published_at REAL,
    due_at REAL,                            -- when the live message becomes deliverable
    receives INTEGER NOT NULL DEFAULT 0,    -- deliveries since the last outcome (poison)
    received_at REAL,
    leased_until REAL,                      -- a consumer holds the message until then
    UNIQUE (run_id, recipient_id)
);
CREATE INDEX IF NOT EXISTS operations_state ON operations(state);
CREATE INDEX IF NOT EXISTS operations_run_state ON operations(run_id, state);
CREATE INDEX IF NOT EXISTS operations_run_id ON operations(run_id, id);

CREATE TABLE IF NOT EXISTS attempts (
    id INTEGER PRIMARY KEY,
    operation_id TEXT NOT NULL REFERENCES operations(id),
    n INTEGER NOT NULL,
    kind TEXT NOT NULL,                     -- delete | probe | operator
    started_at REAL NOT NULL,
    finished_at REAL,
    status INTEGER,
    outcome TEXT,                           -- NULL while the request may still be in the air
    detail TEXT
);
CREATE INDEX IF NOT EXISTS attempts_operation ON attempts(operation_id);

-- A request (or job) that carried many attempts (docs/batch.md); each attempt it carried
-- names it (attempts.batch_id, batch_position).
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,                    -- ours: the idempotency key and the job's tag
    shape TEXT NOT NULL,
    size INTEGER NOT NULL,
    state TEXT NOT NULL,                    -- formed | sent | submitting | submitted | closed
    created_at REAL NOT NULL,
    job_ref TEXT,                           -- the partner's job reference
    submitted_at REAL,
    polled_at REAL,
    closed_at REAL,
    results_expire_at REAL,
    detail TEXT
);
CREATE INDEX IF NOT EXISTS batches_open ON batches(state, created_at) WHERE state != 'closed';

-- The embedded queue: one row per operation. available_at doubles as the lease expiry,
-- so an expired lease is simply a claimable message again.
CREATE TABLE IF NOT EXISTS messages (
    operation_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    recipient_id TEXT NOT NULL,
    available_at REAL NOT NULL,
    lease_token TEXT,
    receives INTEGER NOT NULL DEFAULT 0,
    enqueued_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_available ON messages(available_at);

-- What the rate budget learnt about one partner (by base URL): its limit, a pause in
-- force, quota use. JSON, small, rewritten after each cut and at the end of each run.
CREATE TABLE IF NOT EXISTS budget_memory (
    key TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    updated_at REAL NOT NULL
);

-- What operators did outside an operation's own attempts (lifting the budget's pause),
-- with who, why and when: an audit log, only ever appended to. A file written by an
-- earlier release gains it at open (CREATE ... IF NOT EXISTS).
CREATE TABLE IF NOT EXISTS operator_actions (
    id INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    action TEXT NOT NULL,                   -- budget.resume
    actor TEXT NOT NULL,                    -- who (the --by of the CLI, the API's "by")
    reason TEXT NOT NULL,
    detail TEXT NOT NULL                    -- JSON: what it changed
);
CREATE INDEX IF NOT EXISTS operator_actions_action ON operator_actions(action, id);

-- The events outbox: one row per settled operation or finished run, written in the
-- transaction of that change. AUTOINCREMENT: a seq is never handed out twice, even after
-- pruning emptied the table, so no cursor can skip a new event; with one writer it is
-- also commit order and gapless (a rolled-back insert gives its number back).
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- outbox order: what a sink's cursor holds
    id TEXT NOT NULL,                       -- the stable event ID receivers dedupe on
    kind TEXT NOT NULL,                     -- operation.settled | run.finished
    at REAL NOT NULL,
    run_id TEXT NOT NULL,
    operation_id TEXT,
    recipient_id TEXT,
    outcome TEXT,                           -- the operation's settled state
    counts TEXT                             -- JSON, a finished run's operations by state
);

-- One cursor per sink: the last event it acknowledged.
CREATE TABLE IF NOT EXISTS event_cursors (
    sink TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    updated_at REAL NOT NULL
);
"""

# Only the unsettled operations: what the queue gauges and redrive read every second or
# minute, however many settled operations a year of runs has left behind. Created after
# the columns it names exist (an older file gains them first).
ACTIVE_INDEX = (
    "CREATE INDEX IF NOT EXISTS operations_active ON operations(state, due_at, leased_until) "
    "WHERE state IN ('queued', 'retry_wait', 'in_flight')"
)

# The attempts a batch carried (created after attempts.batch_id exists).
BATCH_INDEX = (
    "CREATE INDEX IF NOT EXISTS attempts_batch ON attempts(batch_id) WHERE batch_id IS NOT NULL"
)

# Columns added after the first release: an existing ledger file gains them at open.
ADDED_COLUMNS = (
    ("operations", "message_id", "TEXT"),
    ("operations", "published_at", "REAL"),
    ("operations", "due_at", "REAL"),
    ("operations", "receives", "INTEGER NOT NULL DEFAULT 0"),
    ("operations", "received_at", "REAL"),
    ("operations", "leased_until", "REAL"),
    ("runs", "source_kind", "TEXT"),
    ("attempts", "batch_id", "TEXT"),
    ("attempts", "batch_position", "INTEGER"),
)
# A migrated file's runs get their kind from the JSON once, at open.
BACKFILL_SOURCE_KIND = (
    "UPDATE runs SET source_kind = json_extract(source, '$.kind') WHERE source_kind IS NULL"
)
# Work a migrated file had in the queue is due at once, and an operation whose embedded
# message is there has that message live (else the first redrive republishes them all).
BACKFILL_DUE = (
    "UPDATE operations SET due_at = COALESCE(due_at, updated_at),"
    " message_id = COALESCE(message_id, (SELECT m.operation_id FROM messages m"
    " WHERE m.operation_id = operations.id)) WHERE due_at IS NULL"
)

PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    # FULL: a commit survives power loss, not only a killed process; group commit pays
    # for the fsync once per batch.
    "PRAGMA synchronous=FULL",
    "PRAGMA foreign_keys=ON",
    "PRAGMA busy_timeout=5000",
    # 16 MB of page cache (the default is 2 MB): the indexes of a million-operation run
    # stay mostly in memory, while the process stays far below 100 MB.
    "PRAGMA cache_size=-16384",
)

LIST_RUN_COLUMNS = shape.list_run_columns()

# runs
INSERT_RUN = (
    "INSERT INTO runs (id, tick_key, schedule, scheduled_for, state, source, source_kind, "
    "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tick_key) DO NOTHING"
)
SELECT_RUN_BY_TICK = f"SELECT {shape.RUN_COLUMNS} FROM runs WHERE tick_key = ?"
SELECT_RECENT_RUN_OF_SCHEDULE = (
    f"SELECT {shape.RUN_COLUMNS} FROM runs WHERE schedule = ? AND created_at >= ? "
    "ORDER BY created_at DESC LIMIT 1"
)
SELECT_RUN = f"SELECT {shape.RUN_COLUMNS} FROM runs WHERE id = ?"
SELECT_UNFINISHED_RUN = (
    f"SELECT {LIST_RUN_COLUMNS} FROM runs WHERE state != 'done' ORDER BY created_at LIMIT 1"
)
SELECT_RUNS = f"SELECT {LIST_RUN_COLUMNS} FROM runs ORDER BY created_at DESC, id DESC LIMIT ?"
SELECT_RUNS_BEFORE = (
    f"SELECT {LIST_RUN_COLUMNS} FROM runs WHERE (created_at, id) < "
    "(SELECT created_at, id FROM runs WHERE id = ?) ORDER BY created_at DESC, id DESC LIMIT ?"
)
SELECT_RUNS_BY_ID = (
    f"SELECT {LIST_RUN_COLUMNS} FROM runs WHERE id IN (SELECT value FROM json_each(?))"
)
# A schedule's newest run and every unfinished one, oldest first: two index ranges
# (runs_schedule, runs_schedule_unfinished), however many runs the schedule has had.
SELECT_SCHEDULE_RUNS = (
    f"SELECT {LIST_RUN_COLUMNS} FROM runs WHERE schedule = ?1 AND state != 'done' "
    f"UNION SELECT * FROM (SELECT {LIST_RUN_COLUMNS} FROM runs WHERE schedule = ?1 "
    "ORDER BY created_at DESC, id DESC LIMIT 1) ORDER BY created_at, id"
)
SELECT_RUNS_TO_SCAN = f"SELECT {shape.RUN_COLUMNS} FROM runs WHERE state = 'scanning' ORDER BY created_at"
SELECT_CURRENT_RUN = f"SELECT {LIST_RUN_COLUMNS} FROM runs ORDER BY created_at DESC LIMIT 1"
UPDATE_RUN_PAGE = (
    "UPDATE runs SET scan_cursor = ?, scan_pages = scan_pages + 1, "
    "discovered = discovered + ?, skipped_candidates = skipped_candidates + ? "
    "WHERE id = ? AND state = 'scanning' AND scan_cursor IS ?"
)
SELECT_RUN_SCAN = "SELECT state, scan_cursor FROM runs WHERE id = ?"
UPDATE_RUN_SCANNED = (
    "UPDATE runs SET state = 'draining', scan_finished_at = ? WHERE id = ? AND state = 'scanning'"
)
UPDATE_RUN_SCAN_FAILURE = (
    "UPDATE runs SET scan_failures = scan_failures + 1, last_error = ? WHERE id = ?"
)
UPDATE_RUN_SCAN_ABANDONED = (
    "UPDATE runs SET state = 'draining', scan_finished_at = ?, last_error = ? "
    "WHERE id = ? AND state = 'scanning'"
)
# A run is done when nothing is left to act on. Ambiguous operations do not hold it open:
# they wait for evidence, and a stuck run would block every later tick.
UPDATE_RUNS_DONE = (
    "UPDATE runs SET state = 'done', finished_at = ? WHERE state = 'draining' AND NOT EXISTS ("
    " SELECT 1 FROM operations o WHERE o.run_id = runs.id"
    " AND o.state IN ('discovered', 'queued', 'in_flight', 'retry_wait')) RETURNING id"
)
# An operation queued again (a probe found the recipient present, an operator said retry)
# is work again: a run closed meanwhile drains until it is done once more.
REOPEN_RUN = (
    "UPDATE runs SET state = 'draining', finished_at = NULL WHERE id = ? AND state = 'done'"
)
COUNT_RUN_STATES = "SELECT state, COUNT(*) FROM operations WHERE run_id = ? GROUP BY state"
# The run and its counts in one statement, so one snapshot: read apart, a run closed
# before an operation was queued again showed as done with that operation queued.
SELECT_RUN_WITH_COUNTS = (
    f"SELECT {LIST_RUN_COLUMNS}, (SELECT json_group_object(state, n) FROM ("
    " SELECT state, COUNT(*) AS n FROM operations WHERE run_id = ?1 GROUP BY state))"
    " FROM runs WHERE id = ?1"
)
# Every second: only the unsettled (by the state index), never the whole history. An
# inconclusive probe puts the next one off (due_at past the probe's own time): those are
# the ambiguous operations whose last probe was inconclusive.
COUNT_AMBIGUOUS = (
    "SELECT COUNT(*), COUNT(*) FILTER (WHERE due_at > updated_at) FROM operations "
    "WHERE state = 'ambiguous'"
)

# operations
INSERT_OPERATION = (
    "INSERT INTO operations (id, run_id, recipient_id, state, created_at, updated_at) "
    "VALUES (?, ?, ?, 'discovered', ?, ?) ON CONFLICT (run_id, recipient_id) DO NOTHING"
)
SELECT_OPERATION = f"SELECT {shape.OP_COLUMNS} FROM operations WHERE id = ?"
SELECT_OPERATIONS_WITH_OPEN_ATTEMPT = (
    f"SELECT {shape.OP_COLUMNS}, (SELECT a.outcome IS NULL FROM attempts a WHERE a.operation_id = "
    "operations.id ORDER BY a.id DESC LIMIT 1) FROM operations "
    "WHERE id IN (SELECT value FROM json_each(?))"
)
# Paged by operation ID (time-ordered, unique): the cursor means the same in every backend.
SELECT_OPERATIONS = (
    f"SELECT {shape.OP_COLUMNS} FROM operations WHERE run_id = ? AND id > ? ORDER BY id LIMIT ?"
)
SELECT_OPERATIONS_IN_STATE = (
    f"SELECT {shape.OP_COLUMNS} FROM operations WHERE run_id = ? AND state = ? AND id > ? "
    "ORDER BY id LIMIT ?"
)
SELECT_UNPUBLISHED = (
    "SELECT run_id, id, recipient_id FROM operations WHERE state = 'discovered' "
    "ORDER BY rowid LIMIT ?"
)
# The hold is on this process's clock: no database clock to compare it with (NULL).
SELECT_OP_STATE = "SELECT state, attempts, owner, busy_until, NULL FROM operations WHERE id = ?"
# A message is out there for the operation (the outbox's publish, a repost with a delay,
# a redrive). A discovered operation becomes queued; any other keeps its state.
# Never brings a due time forward: a copy handed back or redriven does not cut a retry's
# wait short. A deliberate move of the message starts the poison count again.
# Parameters: message ID, now, due at, operation (RECORD_OUTBOX too).
RECORD_PUBLISHED = (
    "UPDATE operations SET message_id = ?1, published_at = ?2,"
    " due_at = MAX(COALESCE(due_at, 0), ?3), leased_until = NULL, updated_at = ?2,"
    " receives = 0, state = CASE state WHEN 'discovered' THEN 'queued' ELSE state END "
    "WHERE id = ?4 AND state IN ('discovered', 'queued', 'retry_wait', 'in_flight')"
)
# The outbox's record comes after its publish: a consumer may have had the message and
# moved the operation on (even reposted it) meanwhile. Then that bookkeeping stands.
RECORD_OUTBOX = (
    "UPDATE operations SET message_id = COALESCE(message_id, ?1),"
    " published_at = ?2, due_at = COALESCE(due_at, ?3), updated_at = ?2,"
    " state = 'queued' WHERE id = ?4 AND state = 'discovered'"
)
# A delivery arrived, of the live message or of another copy (a repost's predecessor
# whose ack was lost, a publish a killed process never recorded): every copy is the same
# work, and the in-flight guard keeps it to one attempt. No message recorded yet makes
# this one the live one.
# Returned with the count: how much longer the operation is held (an attempt's guard, a
# retry not yet due), as this write saw it. Parameters: now, the lease's end, the
# delivery's message ID, the operation.
_HELD_S = (
    "MAX(0, CASE state WHEN 'in_flight' THEN COALESCE(busy_until, 0) - ?1"
    " WHEN 'retry_wait' THEN COALESCE(due_at, 0) - ?1 ELSE 0 END)"
)
NOTE_RECEIVED = (
    "UPDATE operations SET receives = receives + 1, received_at = ?1,"
    " leased_until = ?2, message_id = COALESCE(message_id, ?3) "
    f"WHERE id = ?4 RETURNING receives, {_HELD_S}"
)
# Per message: a delivery of the message last counted (since the last outcome or move)
# counts nothing more, and the delivery's message is the live one from now on.
NOTE_RECEIVED_ONCE = (
    "UPDATE operations SET receives = CASE WHEN receives > 0 AND message_id = ?3"
    " THEN receives ELSE receives + 1 END, received_at = ?1, leased_until = ?2,"
    f" message_id = ?3 WHERE id = ?4 RETURNING receives, {_HELD_S}"
)
# After an outcome: the receive count starts again; a retry is due after its delay. With
# a transport outside this database the old message is about to be acked (``clear``), so
# no message is live until the repost records its own. Parameters: keep the lease, the
# retry's due time, clear, the operation.
SETTLE_BOOKKEEPING = (
    "UPDATE operations SET receives = 0,"
    " leased_until = CASE WHEN ?1 THEN leased_until ELSE NULL END,"
    " due_at = COALESCE(?2, due_at),"
    " message_id = CASE WHEN ?3 THEN NULL ELSE message_id END "
    "WHERE id = ?4"
)
_ACTIVE = "state IN ('queued', 'retry_wait', 'in_flight')"
_HELD = "(state = 'in_flight' OR COALESCE(leased_until, 0) > ?1)"
_CLAIMABLE = f"(NOT {_HELD} AND due_at <= ?1)"
# The queue as the ledger sees it, for a transport that cannot say: only unsettled rows.
# INDEXED BY: the planner must not trade the partial index for a scan of all history.
LEDGER_QUEUE_STATS = (
    "SELECT"
    f" COUNT(*) FILTER (WHERE {_CLAIMABLE}),"
    f" COUNT(*) FILTER (WHERE NOT {_HELD} AND due_at > ?1),"
    f" COUNT(*) FILTER (WHERE {_HELD}),"
    f" MIN(MAX(due_at, COALESCE(leased_until, 0))) FILTER (WHERE {_CLAIMABLE}) "
    f"FROM operations INDEXED BY operations_active WHERE {_ACTIVE}"
)
# Redrive, from ledger state and age alone: an unsettled operation with no live message
# whose retry is due (a wait past the transport's longest delay, a repost that never
# happened), or one nothing has touched (due, delivered, held, changed) since ``before``:
# the queue has delivered what was due after it, or delivered nothing while it waited.
# ``before`` NULL: the age rule is off. Parameters: before, unposted_before, limit.
SELECT_OVERDUE = (
    "SELECT run_id, id, recipient_id FROM operations INDEXED BY operations_active "
    f"WHERE {_ACTIVE} AND ("
    " (message_id IS NULL AND state != 'in_flight' AND due_at <= ?2)"
    " OR MAX(COALESCE(due_at, 0), COALESCE(leased_until, 0), COALESCE(busy_until, 0),"
    " updated_at) <= ?1) ORDER BY rowid LIMIT ?3"
)


def transition(target: OpState, guard_busy: bool, returning: bool = True) -> str:
    """The guarded state change (:func:`supervisor.ledger.shape.transition`); the hold is
    on the now passed in, this process's clock."""
    return shape.transition(target, guard_busy, "?", returning=returning)


SELECT_OPERATIONS_BY_STATE = (
    f"SELECT {shape.OP_COLUMNS} FROM operations WHERE state = ? AND id > ? ORDER BY id LIMIT ?"
)
# Settled long enough, and not put off by an inconclusive probe (due_at: its backoff).
SELECT_AMBIGUOUS_DUE = (
    f"SELECT {shape.OP_COLUMNS} FROM operations WHERE state = 'ambiguous' AND updated_at <= ? "
    "AND COALESCE(due_at, 0) <= ? ORDER BY updated_at LIMIT ?"
)
PUT_OFF_PROBE = "UPDATE operations SET due_at = ? WHERE id = ?"
INSERT_EVIDENCE = (
    "INSERT INTO attempts (operation_id, n, kind, started_at, finished_at, status, outcome, detail) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)

# attempts
INSERT_ATTEMPT = (
    "INSERT INTO attempts (operation_id, n, kind, started_at) VALUES (?, ?, ?, ?) RETURNING id"
)
FINISH_ATTEMPT = shape.finish_attempt("?")
# The attempt is still the one holding the operation in flight, for long enough.
_OWNED = (
    "id = :id AND state = 'in_flight' AND owner = :owner AND busy_until > :until AND EXISTS ("
    " SELECT 1 FROM attempts a WHERE a.id = :attempt AND a.operation_id = :id"
    " AND a.outcome IS NULL)"
)
OWNS_ATTEMPT = f"SELECT 1 FROM operations WHERE {_OWNED}"
# The same for a batch's members: ?1 a JSON array of [operation, attempt, owner].
OWNS_ATTEMPTS = (
    "SELECT o.id FROM operations o JOIN json_each(?1) c"
    " ON o.id = json_extract(c.value, '$[0]')"
    " WHERE o.state = 'in_flight' AND o.owner = json_extract(c.value, '$[2]')"
    " AND o.busy_until > ?2 AND EXISTS (SELECT 1 FROM attempts a"
    " WHERE a.id = json_extract(c.value, '$[1]') AND a.operation_id = o.id"
    " AND a.outcome IS NULL)"
)
# A renewal never shortens a hold (a batch taken again is held for its token wait too).
KEEP_ATTEMPT = (
    f"UPDATE operations SET busy_until = MAX(busy_until, :busy_until) WHERE {_OWNED}")
# A redelivery found the last attempt unfinished: its outcome is unknown for good.
HAS_OPEN_ATTEMPT = "SELECT 1 FROM attempts WHERE operation_id = ? AND outcome IS NULL LIMIT 1"
# A batch's attempts in one executemany (sqlite/ledger.py, begin_attempts).
SELECT_ATTEMPT_COUNTS = (
    "SELECT id, attempts FROM operations WHERE id IN (SELECT value FROM json_each(?1))"
)
INSERT_ATTEMPT_MANY = "INSERT INTO attempts (operation_id, n, kind, started_at) VALUES (?, ?, ?, ?)"
SELECT_OPEN_ATTEMPTS_OF = (
    "SELECT operation_id, id FROM attempts "
    "WHERE operation_id IN (SELECT value FROM json_each(?1)) AND outcome IS NULL"
)
# The same for many operations (a batch's), in one statement.
CLOSE_OPEN_ATTEMPTS_OF = (
    "UPDATE attempts SET finished_at = ?1, outcome = 'unknown', "
    "detail = 'no outcome recorded (process stopped or lease lost)' "
    "WHERE operation_id IN (SELECT value FROM json_each(?2)) AND outcome IS NULL"
)
CLOSE_OPEN_ATTEMPTS = (
    "UPDATE attempts SET finished_at = ?, outcome = 'unknown', "
    "detail = 'no outcome recorded (process stopped or lease lost)' "
    "WHERE operation_id = ? AND outcome IS NULL"
)
# Paged by position in the operation's log (rows are only ever appended): no limit is all.
SELECT_ATTEMPTS = (
    f"SELECT {shape.ATTEMPT_COLUMNS} FROM attempts WHERE operation_id = ?1 ORDER BY id "
    "LIMIT COALESCE(?2, -1) OFFSET ?3"
)

# embedded queue
INSERT_MESSAGE = (
    "INSERT INTO messages (operation_id, run_id, recipient_id, available_at, enqueued_at) "
    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (operation_id) DO NOTHING"
)
CLAIM_MESSAGES = (
    "UPDATE messages SET available_at = ?, lease_token = ?, receives = receives + 1 "
    "WHERE operation_id IN (SELECT operation_id FROM messages WHERE available_at <= ? "
    "ORDER BY available_at LIMIT ?) RETURNING run_id, operation_id, recipient_id, receives"
)
DELETE_MESSAGE = "DELETE FROM messages WHERE operation_id = ? AND lease_token = ?"
RETRY_MESSAGE = (
    "UPDATE messages SET available_at = ?, lease_token = NULL "
    "WHERE operation_id = ? AND lease_token = ?"
)
EXTEND_MESSAGE = (
    "UPDATE messages SET available_at = ? WHERE operation_id = ? AND lease_token = ?"
)
QUEUE_STATS = (
    "SELECT "
    " COUNT(*) FILTER (WHERE available_at <= :now),"
    " COUNT(*) FILTER (WHERE available_at > :now AND lease_token IS NULL),"
    " COUNT(*) FILTER (WHERE available_at > :now AND lease_token IS NOT NULL),"
    " MIN(available_at) FILTER (WHERE available_at <= :now) "
    "FROM messages"
)
NEXT_AVAILABLE = "SELECT MIN(available_at) FROM messages"
# At start-up, under the data-dir lock, every lease belongs to a process that is gone.
RELEASE_DEAD_LEASES = (
    "UPDATE messages SET available_at = ?, lease_token = NULL "
    "WHERE lease_token IS NOT NULL AND available_at > ?"
)
# Likewise every attempt still held in flight: its owner (a lease) died with that process.
RELEASE_DEAD_OWNERS = (
    "UPDATE operations SET owner = NULL, busy_until = NULL WHERE busy_until IS NOT NULL"
)

INSERT_OPERATOR_ACTION = (
    "INSERT INTO operator_actions (at, action, actor, reason, detail) VALUES (?, ?, ?, ?, ?) "
    "RETURNING id"
)
SELECT_OPERATOR_ACTIONS = (
    "SELECT id, at, action, actor, reason, detail FROM operator_actions WHERE action = ? "
    "ORDER BY id DESC LIMIT ?"
)
SELECT_BUDGET = "SELECT state FROM budget_memory WHERE key = ?"
UPSERT_BUDGET = (
    "INSERT INTO budget_memory (key, state, updated_at) VALUES (?, ?, ?) "
    "ON CONFLICT (key) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at"
)

# events outbox. Identifiers only: the row names the operation, the run and the
# recipient, and the state the operation settled in. Parameters: the event's ID, now, the
# operation (the run).
INSERT_OPERATION_EVENT = (
    "INSERT INTO events (id, kind, at, run_id, operation_id, recipient_id, outcome) "
    f"SELECT ?1, '{shape.OPERATION_SETTLED}', ?2, run_id, id, recipient_id, state "
    "FROM operations WHERE id = ?3"
)
INSERT_RUN_EVENT = (
    "INSERT INTO events (id, kind, at, run_id, counts) "
    f"SELECT ?1, '{shape.RUN_FINISHED}', ?2, ?3, json_group_object(state, n) FROM "
    "(SELECT state, COUNT(*) AS n FROM operations WHERE run_id = ?3 GROUP BY state)"
)
SELECT_EVENTS_AFTER = f"SELECT {shape.EVENT_COLUMNS} FROM events WHERE seq > ? ORDER BY seq LIMIT ?"
# The outbox is gapless from its oldest row to its newest: one writer hands out the seqs
# and pruning only ever removes the oldest. So the backlog past a cursor is the newest seq
# minus the first one past it, plus one: two lookups on the primary key, no count.
EVENT_BACKLOG = (
    "SELECT (SELECT MAX(seq) FROM events) - seq + 1, at FROM events WHERE seq > ? "
    "ORDER BY seq LIMIT 1"
)
SELECT_EVENT_CURSOR = "SELECT seq FROM event_cursors WHERE sink = ?"
UPSERT_EVENT_CURSOR = (
    "INSERT INTO event_cursors (sink, seq, updated_at) VALUES (?, ?, ?) "
    "ON CONFLICT (sink) DO UPDATE SET seq = MAX(seq, excluded.seq), "
    "updated_at = excluded.updated_at"
)
# The oldest events, at most ?3, up to the first that a named sink (?1, a JSON array) has
# not taken (a sink without a cursor yet holds everything; no sink named holds nothing)
# or that was written at or after ?2. Always a prefix of the outbox, which keeps it
# gapless.
PRUNE_EVENTS = (
    "DELETE FROM events WHERE seq IN (SELECT seq FROM events WHERE seq <= MIN("
    " COALESCE((SELECT MIN(COALESCE(c.seq, 0)) FROM json_each(?1) j"
    "  LEFT JOIN event_cursors c ON c.sink = j.value), 9223372036854775807),"
    " COALESCE((SELECT seq - 1 FROM events WHERE at >= ?2 ORDER BY seq LIMIT 1),"
    "  9223372036854775807)) ORDER BY seq LIMIT ?3)"
)


# batches (supervisor/ledger/batches.py); UPDATE_BATCH: id, state, job_ref, submitted_at,
# polled_at, closed_at, results_expire_at, detail (NULL keeps what is there).
_BATCH_COLUMNS = ("id, shape, size, state, created_at, job_ref, submitted_at, polled_at, "
                  "closed_at, results_expire_at, detail")
INSERT_BATCH = (
    "INSERT INTO batches (id, shape, size, state, created_at) "
    "VALUES (?1, ?2, ?3, ?4, ?5)"
)
LINK_ATTEMPT = "UPDATE attempts SET batch_id = ?1, batch_position = ?2 WHERE id = ?3"
UPDATE_BATCH = (
    "UPDATE batches SET state = ?2, job_ref = COALESCE(?3, job_ref), "
    "submitted_at = COALESCE(?4, submitted_at), polled_at = COALESCE(?5, polled_at), "
    "closed_at = COALESCE(?6, closed_at), "
    "results_expire_at = COALESCE(?7, results_expire_at), detail = COALESCE(?8, detail) "
    "WHERE id = ?1 AND state != 'closed'"
)
COUNT_JOBS = (
    "SELECT count(*) FROM batches WHERE state IN ('submitting', 'submitted') AND id != ?1"
)
SELECT_BATCH = f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?1"
SELECT_BATCH_MEMBERS = (
    "SELECT a.operation_id, a.batch_position, a.id, o.recipient_id, a.outcome "
    "FROM attempts a JOIN operations o ON o.id = a.operation_id "
    "WHERE a.batch_id = ?1 ORDER BY a.batch_position"
)
SELECT_OPEN_BATCH_OF = (
    "SELECT b.id, b.shape, b.size, b.state, b.created_at, b.job_ref, b.submitted_at, "
    "b.polled_at, b.closed_at, b.results_expire_at, b.detail FROM attempts a "
    "JOIN batches b ON b.id = a.batch_id WHERE a.operation_id = ?1 AND a.outcome IS NULL "
    "ORDER BY a.id DESC LIMIT 1"
)
SELECT_OPEN_JOBS = (
    f"SELECT {_BATCH_COLUMNS} FROM batches WHERE state IN ('submitting', 'submitted') "
    "ORDER BY created_at"
)

# A batch closes in the commit that writes its last open attempt's outcome: given its ID
# (a settlement that names it), or an operation whose open attempts were closed unknown.
_NO_OPEN = "NOT EXISTS (SELECT 1 FROM attempts a WHERE a.batch_id = batches.id AND a.outcome IS NULL)"
CLOSE_FINISHED_BATCHES = (
    "UPDATE batches SET state = 'closed', closed_at = ?1 "
    f"WHERE id IN (SELECT value FROM json_each(?2)) AND state != 'closed' AND {_NO_OPEN}"
)
# The batches not yet closed that an operation's attempts went out in (?1 the operations).
SELECT_OPEN_BATCHES_OF = (
    "SELECT DISTINCT a.batch_id FROM attempts a JOIN batches b ON b.id = a.batch_id "
    "WHERE a.operation_id IN (SELECT value FROM json_each(?1)) AND b.state != 'closed'"
)
CLOSE_FINISHED_BATCHES_OF = (
    "UPDATE batches SET state = 'closed', closed_at = ?1 WHERE id IN (SELECT batch_id "
    f"FROM attempts WHERE operation_id IN (SELECT value FROM json_each(?2)) AND batch_id IS NOT NULL) "
    f"AND state != 'closed' AND {_NO_OPEN}"
)
