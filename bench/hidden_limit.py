"""Benchmark: hidden-limit (see scenarios.py). For the service it is tick 1 of the
hidden-limit-memory run, so this runs that scenario and prints both rows.

Usage: python bench/hidden_limit.py [--tools service,cron,celery] [--cells a,b] [--rate R] [--quick]
                          [--set section.key=value]
"""

import sys

from scenarios import main

if __name__ == "__main__":
    sys.exit(main(["hidden-limit"]))
