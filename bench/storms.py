"""Benchmark: Retry-After storms over the partner matrix (see scenarios.py).

Usage: python bench/storms.py [--tools ...] [--cells a,b] [--rate R] [--quick] [--set ...]
"""

import sys

from scenarios import main

if __name__ == "__main__":
    sys.exit(main(["storms"]))
