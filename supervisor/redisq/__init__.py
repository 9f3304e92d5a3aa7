"""Redis as a transport: the work queue on Redis Streams."""
