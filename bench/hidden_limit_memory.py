"""Benchmark: hidden-limit-memory, a second tick after a restart (see scenarios.py).

Usage: python bench/hidden_limit_memory.py [--tools service] [--cells a,b] [--rate R] [--quick]
                                          [--set section.key=value]
"""

import sys

from scenarios import main

if __name__ == "__main__":
    sys.exit(main(["hidden-limit-memory"]))
