"""The ledger: runs, operations and attempts. The state machine is enforced here.

``base`` is the protocol the service holds; ``core`` the rules, once, for every database;
``driver`` what a database supplies to it (statements by name, a unit of work); ``shape``,
``rows`` and ``ids`` the SQL shapes, row mappers and IDs both dialects share. The
databases themselves are supervisor/sqlite and supervisor/postgres.
"""
