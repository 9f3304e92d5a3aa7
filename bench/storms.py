"""Benchmark: Retry-After storms, both formats (delay-seconds, HTTP-date).

Usage: python bench/storms.py [--tools ...] [--set ...]
"""

import sys

from scenarios import main

if __name__ == "__main__":
    sys.exit(main(["storms-seconds", "storms-http-date"]))
