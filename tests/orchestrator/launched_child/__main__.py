"""`python -m tests.orchestrator.launched_child`: reads one command line from stdin, prints one JSON line
of what a start could get wrong (its `__name__`, argv, working directory, the variables named by
LAUNCHED_CHILD_VARS, stdin's line, its CPU affinity, nice value and umask), then obeys the command:

- `exit N`: exit with code N;
- `stderr TEXT`: write TEXT to stderr, then exit 0;
- `raise`: raise an exception (the interpreter's exit code 1 and a traceback);
- `wait`: wait until stdin ends (the parent closed it), then exit 0.
"""

from __future__ import annotations

import json
import os
import sys


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def main() -> int:
    line = sys.stdin.readline().strip()
    names = os.environ.get("LAUNCHED_CHILD_VARS", "").split(",")
    print(
        json.dumps(
            {
                "name": __name__,
                "argv": sys.argv[1:],
                "cwd": os.getcwd(),
                "vars": {n: os.environ.get(n) for n in names if n},
                "line": line,
                "pid": os.getpid(),
                "cpus": sorted(os.sched_getaffinity(0)),
                "nice": os.getpriority(os.PRIO_PROCESS, 0),
                "umask": _umask(),
            }
        ),
        flush=True,
    )
    command, _, arg = line.partition(" ")
    if command == "exit":
        return int(arg)
    if command == "stderr":
        print(arg, file=sys.stderr, flush=True)
        return 0
    if command == "raise":
        raise RuntimeError("asked to fail")
    if command == "wait":
        while sys.stdin.buffer.read(1 << 16):
            pass
        return 0
    return 3


if __name__ == "__main__":
    sys.exit(main())
