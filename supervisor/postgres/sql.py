"""Every SQL statement of the PostgreSQL ledger, queue and replica registry, by name.

The same state changes as supervisor/sqlite/sql.py, with the parameters numbered alike
(the ledger's core passes the same arguments to both), in PostgreSQL's dialect: ``$n``
parameters, GREATEST/LEAST, arrays instead of json_each, and what only
several writers need: an owner (``holder``, a replica) on every lease and in-flight guard,
claims with ``FOR UPDATE SKIP LOCKED``, NOTIFY on the writes other replicas wait for.
Times are epoch seconds (double precision), as in the SQLite file. What replicas compare
with one another's writes uses the database's clock (``DB_NOW``), never a replica's own:
the registry (who is dead), the queue table's leases and delays (``available_at``), and
the in-flight guards (``busy_until``), so a replica whose clock is off can neither claim a
lease a peer still holds nor pass a peer's guard.
"""

from __future__ import annotations

from supervisor.ledger import shape
from supervisor.postgres.connect import Migration
from supervisor.states import OpState

_T = "DOUBLE PRECISION"
MIGRATIONS = (
    Migration("ledger", 1, (
        f"""CREATE TABLE runs (
            id TEXT PRIMARY KEY,
            tick_key TEXT NOT NULL UNIQUE,
            schedule TEXT NOT NULL,
            scheduled_for {_T},
            state TEXT NOT NULL,
            source TEXT NOT NULL,
            scan_cursor TEXT,
            scan_pages INTEGER NOT NULL DEFAULT 0,
            discovered INTEGER NOT NULL DEFAULT 0,
            skipped_candidates INTEGER NOT NULL DEFAULT 0,
            scan_failures INTEGER NOT NULL DEFAULT 0,
            last_error TEXT,
            created_at {_T} NOT NULL,
            scan_finished_at {_T},
            finished_at {_T})""",
        "CREATE INDEX runs_unfinished ON runs(state) WHERE state != 'done'",
        "CREATE INDEX runs_created ON runs(created_at, id)",
        f"""CREATE TABLE operations (
            id TEXT PRIMARY KEY,
            run_id TEXT NOT NULL REFERENCES runs(id),
            recipient_id TEXT NOT NULL,
            state TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            reason TEXT,
            created_at {_T} NOT NULL,
            updated_at {_T} NOT NULL,
            owner TEXT,
            holder TEXT,
            busy_until {_T},
            message_id TEXT,
            published_at {_T},
            due_at {_T},
            receives INTEGER NOT NULL DEFAULT 0,
            received_at {_T},
            leased_until {_T},
            UNIQUE (run_id, recipient_id))""",
        "CREATE INDEX operations_state ON operations(state, id)",
        "CREATE INDEX operations_run_state ON operations(run_id, state, id)",
        "CREATE INDEX operations_run_id ON operations(run_id, id)",
        "CREATE INDEX operations_active ON operations(state, due_at, leased_until) "
        "WHERE state IN ('queued', 'retry_wait', 'in_flight')",
        "CREATE INDEX operations_held ON operations(holder) WHERE holder IS NOT NULL",
        f"""CREATE TABLE attempts (
            id BIGSERIAL PRIMARY KEY,
            operation_id TEXT NOT NULL REFERENCES operations(id),
            n INTEGER NOT NULL,
            kind TEXT NOT NULL,
            started_at {_T} NOT NULL,
            finished_at {_T},
            status INTEGER,
            outcome TEXT,
            detail TEXT)""",
        "CREATE INDEX attempts_operation ON attempts(operation_id, id)",
        f"""CREATE TABLE messages (
            operation_id TEXT PRIMARY KEY,
            run_id TEXT NOT NULL,
            recipient_id TEXT NOT NULL,
            available_at {_T} NOT NULL,
            lease_token TEXT,
            holder TEXT,
            receives INTEGER NOT NULL DEFAULT 0,
            enqueued_at {_T} NOT NULL)""",
        "CREATE INDEX messages_available ON messages(available_at)",
        "CREATE INDEX messages_held ON messages(holder) WHERE holder IS NOT NULL",
        # Unused since the shared budget keeps its state in rate_budget (postgres/budget.py);
        # left in place, as a migration is never edited.
        f"""CREATE TABLE budget_memory (
            key TEXT PRIMARY KEY, state TEXT NOT NULL, updated_at {_T} NOT NULL)""",
        f"""CREATE TABLE events (
            seq BIGSERIAL PRIMARY KEY,
            id TEXT NOT NULL,
            kind TEXT NOT NULL,
            at {_T} NOT NULL,
            run_id TEXT NOT NULL,
            operation_id TEXT,
            recipient_id TEXT,
            outcome TEXT,
            counts TEXT)""",
        f"""CREATE TABLE event_cursors (
            sink TEXT PRIMARY KEY, seq BIGINT NOT NULL, updated_at {_T} NOT NULL)""",
        f"""CREATE TABLE replicas (
            id TEXT PRIMARY KEY,
            host TEXT NOT NULL,
            pid INTEGER NOT NULL,
            started_at {_T} NOT NULL,
            heartbeat_at {_T} NOT NULL)""",
    )),
    # The session holding a replica's role locks: the reaper ends it with the replica, so
    # a holder whose host died (no FIN, no RST) gives its roles up within seconds.
    Migration("ledger", 2, ("ALTER TABLE replicas ADD COLUMN IF NOT EXISTS roles_pid INTEGER",)),
    # What operators did outside an operation's own attempts (lifting the budget's pause):
    # an audit log. A component of its own, so its versions never collide with the
    # ledger's.
    Migration("audit", 1, (
        f"""CREATE TABLE IF NOT EXISTS operator_actions (
            id BIGSERIAL PRIMARY KEY,
            at {_T} NOT NULL,
            action TEXT NOT NULL,
            actor TEXT NOT NULL,
            reason TEXT NOT NULL,
            detail TEXT NOT NULL)""",
        "CREATE INDEX IF NOT EXISTS operator_actions_action ON operator_actions(action, id)",
    )),
    # List reads show a run's source kind without its JSON (an inline run's IDs), and
    # exclusions read a schedule's newest and unfinished runs through an index.
    Migration("ledger", 3, (
        "ALTER TABLE runs ADD COLUMN IF NOT EXISTS source_kind TEXT",
        "UPDATE runs SET source_kind = source::json->>'kind' WHERE source_kind IS NULL",
        "CREATE INDEX IF NOT EXISTS runs_schedule ON runs(schedule, created_at, id)",
        "CREATE INDEX IF NOT EXISTS runs_schedule_unfinished ON runs(schedule, created_at, id) "
        "WHERE state != 'done'",
    )),
    # Batch partners (docs/batch.md): the request or job that carried many attempts.
    Migration("ledger", 4, (
        f"""CREATE TABLE IF NOT EXISTS batches (
            id TEXT PRIMARY KEY,
            shape TEXT NOT NULL,
            size INTEGER NOT NULL,
            state TEXT NOT NULL,
            created_at {_T} NOT NULL,
            job_ref TEXT,
            submitted_at {_T},
            polled_at {_T},
            closed_at {_T},
            results_expire_at {_T},
            detail TEXT)""",
        "CREATE INDEX IF NOT EXISTS batches_open ON batches(state, created_at) "
        "WHERE state != 'closed'",
        "ALTER TABLE attempts ADD COLUMN IF NOT EXISTS batch_id TEXT",
        "ALTER TABLE attempts ADD COLUMN IF NOT EXISTS batch_position INTEGER",
        "CREATE INDEX IF NOT EXISTS attempts_batch ON attempts(batch_id) "
        "WHERE batch_id IS NOT NULL",
    )),
)

DB_NOW = "extract(epoch from clock_timestamp())::double precision"

# A run a replica of the previous release opened during a rolling upgrade has no
# source_kind: its JSON still says.
LIST_RUN_COLUMNS = shape.list_run_columns(
    "COALESCE(source_kind, source::json->>'kind') AS source_kind")

# runs
INSERT_RUN = (
    "INSERT INTO runs (id, tick_key, schedule, scheduled_for, state, source, source_kind, "
    "created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (tick_key) DO NOTHING"
)
SELECT_RUN_BY_TICK = f"SELECT {shape.RUN_COLUMNS} FROM runs WHERE tick_key = $1"
SELECT_RECENT_RUN_OF_SCHEDULE = (
    f"SELECT {shape.RUN_COLUMNS} FROM runs WHERE schedule = $1 AND created_at >= $2 "
    "ORDER BY created_at DESC LIMIT 1"
)
SELECT_RUN = f"SELECT {shape.RUN_COLUMNS} FROM runs WHERE id = $1"
SELECT_UNFINISHED_RUN = (
    f"SELECT {LIST_RUN_COLUMNS} FROM runs WHERE state != 'done' ORDER BY created_at LIMIT 1"
)
SELECT_RUNS = f"SELECT {LIST_RUN_COLUMNS} FROM runs ORDER BY created_at DESC, id DESC LIMIT $1"
SELECT_RUNS_BEFORE = (
    f"SELECT {LIST_RUN_COLUMNS} FROM runs WHERE (created_at, id) < "
    "(SELECT created_at, id FROM runs WHERE id = $1) ORDER BY created_at DESC, id DESC LIMIT $2"
)
SELECT_RUNS_BY_ID = f"SELECT {LIST_RUN_COLUMNS} FROM runs WHERE id = ANY($1::text[])"
SELECT_SCHEDULE_RUNS = (
    f"SELECT {LIST_RUN_COLUMNS} FROM runs WHERE schedule = $1 AND state != 'done' "
    f"UNION SELECT * FROM (SELECT {LIST_RUN_COLUMNS} FROM runs WHERE schedule = $1 "
    "ORDER BY created_at DESC, id DESC LIMIT 1) newest ORDER BY created_at, id"
)
SELECT_RUNS_TO_SCAN = (
    f"SELECT {shape.RUN_COLUMNS} FROM runs WHERE state = 'scanning' ORDER BY created_at"
)
SELECT_CURRENT_RUN = f"SELECT {LIST_RUN_COLUMNS} FROM runs ORDER BY created_at DESC LIMIT 1"
# Only from the cursor the scan resumed from: a second scanner (a holder that lost its
# role without knowing) cannot write a page over the one that took over.
UPDATE_RUN_PAGE = (
    "UPDATE runs SET scan_cursor = $1, scan_pages = scan_pages + 1, "
    "discovered = discovered + $2, skipped_candidates = skipped_candidates + $3 "
    "WHERE id = $4 AND state = 'scanning' AND scan_cursor IS NOT DISTINCT FROM $5"
)
SELECT_RUN_SCAN = "SELECT state, scan_cursor FROM runs WHERE id = $1"
UPDATE_RUN_SCANNED = (
    "UPDATE runs SET state = 'draining', scan_finished_at = $1 WHERE id = $2 "
    "AND state = 'scanning'"
)
UPDATE_RUN_SCAN_FAILURE = (
    "UPDATE runs SET scan_failures = scan_failures + 1, last_error = $1 WHERE id = $2"
)
UPDATE_RUN_SCAN_ABANDONED = (
    "UPDATE runs SET state = 'draining', scan_finished_at = $1, last_error = $2 "
    "WHERE id = $3 AND state = 'scanning'"
)
UPDATE_RUNS_DONE = (
    "UPDATE runs SET state = 'done', finished_at = $1 WHERE state = 'draining' AND NOT EXISTS ("
    " SELECT 1 FROM operations o WHERE o.run_id = runs.id"
    " AND o.state IN ('discovered', 'queued', 'in_flight', 'retry_wait')) RETURNING id"
)
REOPEN_RUN = (
    "UPDATE runs SET state = 'draining', finished_at = NULL WHERE id = $1 AND state = 'done'"
)
COUNT_RUN_STATES = "SELECT state, COUNT(*) FROM operations WHERE run_id = $1 GROUP BY state"
# The run and its counts in one statement, so one snapshot (as SQLite's).
SELECT_RUN_WITH_COUNTS = (
    f"SELECT {LIST_RUN_COLUMNS}, (SELECT json_object_agg(state, n) FROM ("
    " SELECT state, COUNT(*) AS n FROM operations WHERE run_id = $1 GROUP BY state) c)::text"
    " FROM runs WHERE id = $1"
)
COUNT_AMBIGUOUS = (
    "SELECT COUNT(*), COUNT(*) FILTER (WHERE due_at > updated_at) FROM operations "
    "WHERE state = 'ambiguous'"
)

# operations
INSERT_OPERATIONS = (
    "WITH added AS (INSERT INTO operations (id, run_id, recipient_id, state, created_at, "
    "updated_at) SELECT u.id, $3, u.rid, 'discovered', $4, $4 "
    "FROM unnest($1::text[], $2::text[]) AS u(id, rid) "
    "ON CONFLICT (run_id, recipient_id) DO NOTHING RETURNING 1) SELECT COUNT(*) FROM added"
)
SELECT_OPERATION = f"SELECT {shape.OP_COLUMNS} FROM operations WHERE id = $1"
SELECT_OPERATIONS_WITH_OPEN_ATTEMPT = (
    f"SELECT {shape.OP_COLUMNS}, (SELECT a.outcome IS NULL FROM attempts a WHERE a.operation_id = "
    "operations.id ORDER BY a.id DESC LIMIT 1) FROM operations WHERE id = ANY($1::text[])"
)
# Paged by operation ID: time-ordered, unique, and no storage row ID in any cursor.
SELECT_OPERATIONS = (
    f"SELECT {shape.OP_COLUMNS} FROM operations WHERE run_id = $1 AND id > $2 ORDER BY id LIMIT $3"
)
SELECT_OPERATIONS_IN_STATE = (
    f"SELECT {shape.OP_COLUMNS} FROM operations WHERE run_id = $1 AND state = $2 AND id > $3 "
    "ORDER BY id LIMIT $4"
)
SELECT_OPERATIONS_BY_STATE = (
    f"SELECT {shape.OP_COLUMNS} FROM operations WHERE state = $1 AND id > $2 ORDER BY id LIMIT $3"
)
SELECT_UNPUBLISHED = (
    "SELECT run_id, id, recipient_id FROM operations WHERE state = 'discovered' "
    "ORDER BY id LIMIT $1"
)
SELECT_OP_STATE = (
    f"SELECT state, attempts, owner, busy_until, {DB_NOW} FROM operations WHERE id = $1"
)
RECORD_PUBLISHED = (
    "UPDATE operations SET message_id = $1, published_at = $2,"
    " due_at = GREATEST(COALESCE(due_at, 0), $3), leased_until = NULL, updated_at = $2,"
    " receives = 0, state = CASE state WHEN 'discovered' THEN 'queued' ELSE state END "
    "WHERE id = $4 AND state IN ('discovered', 'queued', 'retry_wait', 'in_flight')"
)
RECORD_OUTBOX = (
    "UPDATE operations SET message_id = COALESCE(message_id, $1),"
    " published_at = $2, due_at = COALESCE(due_at, $3), updated_at = $2,"
    " state = 'queued' WHERE id = $4 AND state = 'discovered'"
)
# Returned with the count: how much longer the operation is held (an attempt's guard, a
# retry not yet due), as this write saw it.
# How long an operation is still held: its in-flight guard, or its retry's due time ($1,
# the ledger's now: both are on the database's clock, see the module docstring).
_HELD_S = (
    f"GREATEST(0, CASE state WHEN 'in_flight' THEN COALESCE(busy_until, 0) - {DB_NOW}"
    " WHEN 'retry_wait' THEN COALESCE(due_at, 0) - $1 ELSE 0 END)"
)
NOTE_RECEIVED = (
    "UPDATE operations SET receives = receives + 1, received_at = $1,"
    " leased_until = $2, message_id = COALESCE(message_id, $3) "
    f"WHERE id = $4 RETURNING receives, {_HELD_S}"
)
# Per message: a delivery of the message last counted counts nothing more, and is live.
NOTE_RECEIVED_ONCE = (
    "UPDATE operations SET receives = CASE WHEN receives > 0 AND message_id = $3"
    " THEN receives ELSE receives + 1 END, received_at = $1, leased_until = $2,"
    f" message_id = $3 WHERE id = $4 RETURNING receives, {_HELD_S}"
)
SETTLE_BOOKKEEPING = (
    "UPDATE operations SET receives = 0,"
    " leased_until = CASE WHEN $1 THEN leased_until ELSE NULL END,"
    " due_at = COALESCE($2, due_at),"
    " message_id = CASE WHEN $3 THEN NULL ELSE message_id END "
    "WHERE id = $4"
)
_ACTIVE = "state IN ('queued', 'retry_wait', 'in_flight')"
_HELD = "(state = 'in_flight' OR COALESCE(leased_until, 0) > $1)"
_CLAIMABLE = f"(NOT {_HELD} AND due_at <= $1)"
LEDGER_QUEUE_STATS = (
    "SELECT"
    f" COUNT(*) FILTER (WHERE {_CLAIMABLE}),"
    f" COUNT(*) FILTER (WHERE NOT {_HELD} AND due_at > $1),"
    f" COUNT(*) FILTER (WHERE {_HELD}),"
    f" MIN(GREATEST(due_at, COALESCE(leased_until, 0))) FILTER (WHERE {_CLAIMABLE}) "
    f"FROM operations WHERE {_ACTIVE}"
)
SELECT_OVERDUE = (
    "SELECT run_id, id, recipient_id FROM operations "
    f"WHERE {_ACTIVE} AND ("
    " (message_id IS NULL AND state != 'in_flight' AND due_at <= $2)"
    " OR GREATEST(COALESCE(due_at, 0), COALESCE(leased_until, 0), COALESCE(busy_until, 0),"
    " updated_at) <= $1) ORDER BY id LIMIT $3"
)


def transition(target: OpState, guard_busy: bool) -> str:
    """The guarded state change (:func:`supervisor.ledger.shape.transition`), naming the
    replica that holds the operation ($8). The guard and the hold are on the database's
    clock: every replica compares them with the same one."""
    return shape.transition(target, guard_busy, "$", clock=DB_NOW, holder=True)


# The attempt still holds its operation in flight: open, ``owner``'s on this replica
# (``holder``), its hold not run out, and the replica registered as alive. Parameters:
# id, attempt, owner, holder, the hold's margin, the heartbeat's freshness.
_OWNED = (
    "o.id = $1 AND o.state = 'in_flight' AND o.owner = $3 AND o.holder = $4"
    " AND EXISTS (SELECT 1 FROM attempts a WHERE a.id = $2 AND a.operation_id = $1"
    " AND a.outcome IS NULL)"
)
OWNS_ATTEMPT = (
    f"SELECT 1 FROM operations o WHERE {_OWNED} AND o.busy_until > {DB_NOW} + $5"
    f" AND EXISTS (SELECT 1 FROM replicas r WHERE r.id = $4 AND r.heartbeat_at > {DB_NOW} - $6)"
)
# The same for a batch's members: $1, $2, $3 the operations, attempts and owners.
OWNS_ATTEMPTS = (
    "SELECT o.id FROM operations o"
    " JOIN unnest($1::text[], $2::bigint[], $3::text[]) AS c(id, attempt, owner) ON o.id = c.id"
    f" WHERE o.state = 'in_flight' AND o.owner = c.owner AND o.holder = $4"
    f" AND o.busy_until > {DB_NOW} + $5"
    " AND EXISTS (SELECT 1 FROM attempts a WHERE a.id = c.attempt AND a.operation_id = o.id"
    " AND a.outcome IS NULL)"
    f" AND EXISTS (SELECT 1 FROM replicas r WHERE r.id = $4 AND r.heartbeat_at > {DB_NOW} - $6)"
)
# A renewal never shortens a hold (a batch taken again is held for its token wait too).
KEEP_ATTEMPT = (
    f"UPDATE operations o SET busy_until = GREATEST(o.busy_until, {DB_NOW} + $5) WHERE {_OWNED}"
    f" AND o.busy_until > {DB_NOW}"
)


SELECT_AMBIGUOUS_DUE = (
    f"SELECT {shape.OP_COLUMNS} FROM operations WHERE state = 'ambiguous' AND updated_at <= $1 "
    "AND COALESCE(due_at, 0) <= $2 ORDER BY updated_at LIMIT $3"
)
PUT_OFF_PROBE = "UPDATE operations SET due_at = $1 WHERE id = $2"

# attempts
INSERT_ATTEMPT = (
    "INSERT INTO attempts (operation_id, n, kind, started_at) VALUES ($1, $2, $3, $4) "
    "RETURNING id"
)
INSERT_EVIDENCE = (
    "INSERT INTO attempts (operation_id, n, kind, started_at, finished_at, status, outcome, "
    "detail) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
)
# No row back: the attempt was already closed (taken over by another replica), or
# another owner holds its operation now.
FINISH_ATTEMPT = shape.finish_attempt("$", text="::text", returning=True)
HAS_OPEN_ATTEMPT = "SELECT 1 FROM attempts WHERE operation_id = $1 AND outcome IS NULL LIMIT 1"
# The same for many operations (a batch's), in one statement.
CLOSE_OPEN_ATTEMPTS_OF = (
    "UPDATE attempts SET finished_at = $1, outcome = 'unknown', "
    "detail = 'no outcome recorded (process stopped or lease lost)' "
    "WHERE operation_id = ANY($2::text[]) AND outcome IS NULL"
)
CLOSE_OPEN_ATTEMPTS = (
    "UPDATE attempts SET finished_at = $1, outcome = 'unknown', "
    "detail = 'no outcome recorded (process stopped or lease lost)' "
    "WHERE operation_id = $2 AND outcome IS NULL"
)
# Paged by position in the operation's log: LIMIT NULL is all.
SELECT_ATTEMPTS = (
    f"SELECT {shape.ATTEMPT_COLUMNS} FROM attempts WHERE operation_id = $1 ORDER BY id "
    "LIMIT $2 OFFSET $3"
)

# the queue table
# The queue table's times (available_at: a delay, or a lease's end) are on the database's
# clock: parameters are delays and leases in seconds from its now.
INSERT_MESSAGE = (
    "INSERT INTO messages (operation_id, run_id, recipient_id, available_at, enqueued_at) "
    f"VALUES ($1, $2, $3, {DB_NOW} + $4::double precision, $5) "
    "ON CONFLICT (operation_id) DO NOTHING"
)
# SKIP LOCKED: replicas claiming at the same moment take different rows instead of
# queueing behind one another's locks.
# Parameters: the lease (seconds), its token, the holder, how many.
CLAIM_MESSAGES = (
    f"UPDATE messages m SET available_at = {DB_NOW} + $1::double precision, lease_token = $2,"
    " holder = $3, receives = m.receives + 1 FROM (SELECT operation_id FROM messages "
    f"WHERE available_at <= {DB_NOW} ORDER BY available_at LIMIT $4 FOR UPDATE SKIP LOCKED) c "
    "WHERE m.operation_id = c.operation_id "
    "RETURNING m.run_id, m.operation_id, m.recipient_id, m.receives"
)
DELETE_MESSAGE = "DELETE FROM messages WHERE operation_id = $1 AND lease_token = $2"
RETRY_MESSAGE = (
    f"UPDATE messages SET available_at = {DB_NOW} + $1::double precision, lease_token = NULL,"
    " holder = NULL WHERE operation_id = $2 AND lease_token = $3"
)
EXTEND_MESSAGE = (
    f"UPDATE messages SET available_at = {DB_NOW} + $1::double precision "
    "WHERE operation_id = $2 AND lease_token = $3"
)
# Ages and waits as seconds from the database's now (a replica adds its own clock).
QUEUE_STATS = (
    f"SELECT COUNT(*) FILTER (WHERE available_at <= n.t),"
    " COUNT(*) FILTER (WHERE available_at > n.t AND lease_token IS NULL),"
    " COUNT(*) FILTER (WHERE available_at > n.t AND lease_token IS NOT NULL),"
    " n.t - MIN(available_at) FILTER (WHERE available_at <= n.t) "
    f"FROM messages, (SELECT {DB_NOW} AS t) n GROUP BY n.t"
)
NEXT_AVAILABLE = f"SELECT MIN(available_at) - {DB_NOW} FROM messages"
NOTIFY = "SELECT pg_notify($1, $2)"

# the replica registry
REGISTER_REPLICA = (
    f"INSERT INTO replicas (id, host, pid, started_at, heartbeat_at) VALUES ($1, $2, $3, "
    f"{DB_NOW}, {DB_NOW}) ON CONFLICT (id) DO UPDATE SET heartbeat_at = {DB_NOW}"
)
HEARTBEAT = f"UPDATE replicas SET heartbeat_at = {DB_NOW} WHERE id = $1 RETURNING 1"
# FOR SHARE: the reaper cannot declare this replica dead while it starts an attempt.
ALIVE = f"SELECT 1 FROM replicas WHERE id = $1 AND heartbeat_at > {DB_NOW} - $2 FOR SHARE"
REAP_REPLICAS = (
    f"DELETE FROM replicas WHERE heartbeat_at <= {DB_NOW} - $1 AND id != $2 "
    "RETURNING id, roles_pid"
)
SET_ROLES_PID = "UPDATE replicas SET roles_pid = pg_backend_pid() WHERE id = $1"
# Only a session of this deployment (its application name): a pid the server has since
# given to another client is left alone.
END_ROLE_SESSIONS = (
    "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity "
    "WHERE pid = ANY($1::int[]) AND application_name = $2"
)
RELEASE_MESSAGES_OF = (
    f"UPDATE messages SET available_at = {DB_NOW}, lease_token = NULL, holder = NULL "
    "WHERE holder = ANY($1::text[])"
)
RELEASE_GUARDS_OF = (
    "UPDATE operations SET owner = NULL, busy_until = NULL, holder = NULL, "
    "leased_until = NULL WHERE holder = ANY($1::text[])"
)
LEAVE = "DELETE FROM replicas WHERE id = $1"
COUNT_REPLICAS = "SELECT COUNT(*) FROM replicas"
LIVE_REPLICAS = (
    f"SELECT id, host, pid, started_at, heartbeat_at, {DB_NOW} FROM replicas ORDER BY started_at"
)

INSERT_OPERATOR_ACTION = (
    "INSERT INTO operator_actions (at, action, actor, reason, detail) "
    "VALUES ($1, $2, $3, $4, $5) RETURNING id"
)
SELECT_OPERATOR_ACTIONS = (
    "SELECT id, at, action, actor, reason, detail FROM operator_actions WHERE action = $1 "
    "ORDER BY id DESC LIMIT $2"
)

# events outbox
INSERT_OPERATION_EVENT = (
    "INSERT INTO events (id, kind, at, run_id, operation_id, recipient_id, outcome) "
    f"SELECT $1, '{shape.OPERATION_SETTLED}', $2, run_id, id, recipient_id, state "
    "FROM operations WHERE id = $3"
)
INSERT_RUN_EVENT = (
    f"INSERT INTO events (id, kind, at, run_id, counts) SELECT $1, '{shape.RUN_FINISHED}', $2, $3, "
    "COALESCE((SELECT json_object_agg(state, n)::text FROM (SELECT state, COUNT(*) AS n "
    "FROM operations WHERE run_id = $3 GROUP BY state) s), '{}')"
)
SELECT_EVENTS_AFTER = (
    f"SELECT {shape.EVENT_COLUMNS} FROM events WHERE seq > $1 ORDER BY seq LIMIT $2"
)
# Sequences leave gaps in PostgreSQL (a rolled-back insert keeps its number): count.
EVENT_BACKLOG = "SELECT COUNT(*), MIN(at) FROM events WHERE seq > $1"
SELECT_EVENT_CURSOR = "SELECT seq FROM event_cursors WHERE sink = $1"
UPSERT_EVENT_CURSOR = (
    "INSERT INTO event_cursors (sink, seq, updated_at) VALUES ($1, $2, $3) "
    "ON CONFLICT (sink) DO UPDATE SET seq = GREATEST(event_cursors.seq, excluded.seq), "
    "updated_at = excluded.updated_at"
)
PRUNE_EVENTS = (
    "DELETE FROM events WHERE seq IN (SELECT seq FROM events WHERE seq <= LEAST("
    " COALESCE((SELECT MIN(COALESCE(c.seq, 0)) FROM unnest($1::text[]) AS j(sink)"
    "  LEFT JOIN event_cursors c ON c.sink = j.sink), 9223372036854775807),"
    " COALESCE((SELECT seq - 1 FROM events WHERE at >= $2 ORDER BY seq LIMIT 1),"
    "  9223372036854775807)) ORDER BY seq LIMIT $3)"
)


# batches (supervisor/ledger/batches.py); UPDATE_BATCH: id, state, job_ref, submitted_at,
# polled_at, closed_at, results_expire_at, detail (NULL keeps what is there).
_BATCH_COLUMNS = ("id, shape, size, state, created_at, job_ref, submitted_at, polled_at, "
                  "closed_at, results_expire_at, detail")
INSERT_BATCH = (
    "INSERT INTO batches (id, shape, size, state, created_at) "
    "VALUES ($1, $2, $3, $4, $5)"
)
LINK_ATTEMPT = "UPDATE attempts SET batch_id = $1, batch_position = $2 WHERE id = $3"
UPDATE_BATCH = (
    "UPDATE batches SET state = $2, job_ref = COALESCE($3, job_ref), "
    "submitted_at = COALESCE($4, submitted_at), polled_at = COALESCE($5, polled_at), "
    "closed_at = COALESCE($6, closed_at), "
    "results_expire_at = COALESCE($7, results_expire_at), detail = COALESCE($8, detail) "
    "WHERE id = $1 AND state != 'closed'"
)
COUNT_JOBS = (
    "SELECT count(*) FROM batches WHERE state IN ('submitting', 'submitted') AND id != $1"
)
SELECT_BATCH = f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = $1"
SELECT_BATCH_MEMBERS = (
    "SELECT a.operation_id, a.batch_position, a.id, o.recipient_id, a.outcome "
    "FROM attempts a JOIN operations o ON o.id = a.operation_id "
    "WHERE a.batch_id = $1 ORDER BY a.batch_position"
)
SELECT_OPEN_BATCH_OF = (
    "SELECT b.id, b.shape, b.size, b.state, b.created_at, b.job_ref, b.submitted_at, "
    "b.polled_at, b.closed_at, b.results_expire_at, b.detail FROM attempts a "
    "JOIN batches b ON b.id = a.batch_id WHERE a.operation_id = $1 AND a.outcome IS NULL "
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
    "UPDATE batches SET state = 'closed', closed_at = $1 "
    f"WHERE id IN (SELECT unnest($2::text[])) AND state != 'closed' AND {_NO_OPEN}"
)
# The batches not yet closed that an operation's attempts went out in ($1 the operations).
SELECT_OPEN_BATCHES_OF = (
    "SELECT DISTINCT a.batch_id FROM attempts a JOIN batches b ON b.id = a.batch_id "
    "WHERE a.operation_id IN (SELECT unnest($1::text[])) AND b.state != 'closed'"
)
