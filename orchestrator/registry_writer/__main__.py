"""`python -m orchestrator.registry_writer`: the registry writer process (see worker.py). Reads its config
line from stdin and ends when stdin closes (the parent exited or was killed)."""

from __future__ import annotations

import sys

from orchestrator.child_process import lifeline, read_config
from orchestrator.registry_writer.worker import WriterConfig, serve_forever


def main() -> int:
    config: WriterConfig = read_config()
    lifeline("kvresume-registry-writer-lifeline")
    serve_forever(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
