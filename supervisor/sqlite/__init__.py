"""SQLite: the embedded shape's ledger, its table queue and their one database file."""
