"""`python -m orchestrator.model_process`: the model process (see worker.py). Reads its config line from
stdin and ends when stdin closes (the parent exited or was killed)."""

from __future__ import annotations

import sys

from orchestrator.child_process import lifeline, read_config
from orchestrator.cpu_split import pin_process
from orchestrator.model_process.worker import WorkerConfig, serve_forever


def main() -> int:
    config: WorkerConfig = read_config()
    if config.cpus:
        # before the models load and torch starts its threads (each inherits its creator's CPUs)
        pin_process(config.cpus)
    lifeline("kvresume-model-lifeline")
    serve_forever(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
