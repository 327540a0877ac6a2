"""`python -m orchestrator.model_process`: the model process (see worker.py). Reads its config line from
stdin and ends when stdin closes (the parent exited or was killed)."""

from __future__ import annotations

import os
import sys
import threading

from orchestrator.cpu_split import pin_process
from orchestrator.model_process.wire import loads
from orchestrator.model_process.worker import WorkerConfig, serve_forever


def _watch_parent() -> None:
    try:
        while sys.stdin.buffer.read(1 << 16):
            pass
    finally:
        os._exit(0)


def main() -> int:
    line = sys.stdin.buffer.readline()
    config: WorkerConfig = loads(bytes.fromhex(line.decode().strip()))
    if config.cpus:
        # before the models load and torch starts its threads (each inherits its creator's CPUs)
        pin_process(config.cpus)
    threading.Thread(target=_watch_parent, name="kvresume-model-lifeline", daemon=True).start()
    serve_forever(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
