"""Looking at other processes from a test."""

from __future__ import annotations


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, its stat was read
        return False
