"""Benchmark: known-limit (see scenarios.py).

Usage: python bench/known_limit.py [--tools service,cron,celery] [--cells a,b] [--rate R] [--quick]
                          [--set section.key=value]
"""

import sys

from scenarios import main

if __name__ == "__main__":
    sys.exit(main(["known-limit"]))
