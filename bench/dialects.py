"""Benchmark: the partner's header dialects (see scenarios.py, matrix.DIALECT_CELLS).

Usage: python bench/dialects.py [--quick] [--set section.key=value]
"""

import sys

from scenarios import DIALECTS, main

if __name__ == "__main__":
    sys.exit(main(list(DIALECTS)))
