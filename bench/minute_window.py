"""Benchmark: minute-window (see scenarios.py).

Usage: python bench/minute_window.py [--tools service,cron,celery] [--set section.key=value]
"""

import sys

from scenarios import main

if __name__ == "__main__":
    sys.exit(main(["minute-window"]))
