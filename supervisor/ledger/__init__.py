"""The ledger: runs, operations and attempts. The state machine is enforced here."""
