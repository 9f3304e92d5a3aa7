"""PostgreSQL: every statement and connection of the replicas shape (ledger, table queue,
shared budget row, replica membership and roles, migrations)."""
