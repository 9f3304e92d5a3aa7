"""Benchmark: ratelimit-headers (see scenarios.py).

Usage: python bench/ratelimit_headers.py [--tools service,cron,celery] [--set section.key=value]
"""

import sys

from scenarios import main

if __name__ == "__main__":
    sys.exit(main(["ratelimit-headers"]))
