"""Benchmark: hidden-limit-memory, a second tick after a restart (see scenarios.py); its
first tick is the hidden-limit row, which the peers run alone.

Usage: python bench/hidden_limit_memory.py [--tools service,cron,celery] [--cells a,b] [--rate R]
                                          [--quick] [--set section.key=value]
"""

import sys

from scenarios import main

if __name__ == "__main__":
    sys.exit(main(["hidden-limit-memory"]))
