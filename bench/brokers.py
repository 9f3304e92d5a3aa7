"""Benchmark: the known-limit case (1,500 at 50/s) and capacity (10,000, partner
unlimited) with Redis Streams and RabbitMQ as the queue, and with ``--article`` the
article's 18,400 at 20/s through each (31 more minutes); the service alone, each run on a
queue of its own on this machine's broker. Rows report the ratio to N / R and the
broker round trips per operation (cleanup_queue_calls_total).

Usage: python bench/brokers.py [--article] [--set section.key=value]
"""

import sys

from scenarios import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    names = [f"{q}-{case}" for q in ("redis", "rabbitmq") for case in ("known-limit", "capacity")]
    if "--article" in argv:
        argv.remove("--article")
        names += ["redis-article", "rabbitmq-article"]
    sys.exit(main(names, argv, stem="brokers"))
