"""Benchmark: capacity (see scenarios.py).

Usage: python bench/capacity.py [--tools service,cron,celery] [--set section.key=value]
"""

import sys

from scenarios import main

if __name__ == "__main__":
    sys.exit(main(["capacity"]))
