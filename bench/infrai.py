"""Benchmark: the service with Infrai as its queue (the emulator, 20 ms added to every
call): the known-limit case (1,500 at 50/s) and the article's (18,400 at 20/s, about
16 minutes). Reports the ratio to N / rate and Infrai calls per operation (each billed).

Usage: python bench/infrai.py [--quick] [--only infrai-known-limit] [--set section.key=value]
"""

import sys

from scenarios import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    names = ["infrai-known-limit", "infrai-article"]
    if "--only" in argv:
        i = argv.index("--only")
        names = argv[i + 1].split(",")
        argv = argv[:i] + argv[i + 2:]
    sys.exit(main(names, [*argv, "--tools", "service"]))
