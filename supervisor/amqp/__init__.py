"""RabbitMQ as a transport: the work queue on a quorum queue (AMQP 0-9-1)."""
