"""Benchmark: the article's 18,400 at 20/s with the limit hidden (ceiling 40/s), against a
bucket of one and behind nginx limit_req without and with a static Retry-After: 1 (see
scenarios.py and gateway.py). About 50 minutes; the service alone.

Usage: python bench/long_hidden.py [--only bucket-1,nginx,nginx-retry-after] [--set section.key=value]
"""

import sys

from scenarios import FULL_ONLY, main

LONG = [name for name in FULL_ONLY if name.startswith("article-hidden-")]

if __name__ == "__main__":
    argv = sys.argv[1:]
    names = LONG
    if "--only" in argv:
        i = argv.index("--only")
        wanted = {f"article-hidden-{c.strip()}" for c in argv[i + 1].split(",")}
        names = [n for n in LONG if n in wanted]
        argv = argv[:i] + argv[i + 2:]
    sys.exit(main(names, argv, stem="article-hidden"))
