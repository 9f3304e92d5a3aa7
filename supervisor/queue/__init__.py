"""The queue: transport for one small message per operation."""
