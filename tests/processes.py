"""Looking at other processes from a test."""

from __future__ import annotations

from pathlib import Path


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, its stat was read
        return False


def parent_of(pid: int) -> int:
    """The parent of `pid`, or -1 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return -1


def children_of(pid: int) -> list[int]:
    """The children of `pid` (every thread's), [] once it is gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    found = []
    for task in tasks:
        try:
            found.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue  # a thread that ended meanwhile
    return found


def descendants_of(pid: int) -> list[int]:
    """Every process below `pid`, children before grandchildren."""
    found, todo = [], children_of(pid)
    while todo:
        found.append(todo.pop(0))
        todo.extend(children_of(found[-1]))
    return found


def cmdline_of(pid: int) -> str:
    """`pid`'s command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
