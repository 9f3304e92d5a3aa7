"""Completion events: a ledger outbox delivered to N sinks (Infrai queues, signed webhooks).

Every settled operation and every finished run is written as one event row in the same
transaction as the state change (supervisor/ledger/core.py). Each configured sink reads
the outbox past its own cursor, delivers in order, at least once, with the stable event ID,
and moves its cursor: a sink that is down delays only itself (supervisor/events/relay.py).

Kept free of imports here: supervisor.config imports the settings module.
"""
