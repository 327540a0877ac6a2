"""Running a benchmark's clients at once: one thread per client, timed from the first start to the last
join."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["run_clients"]


def run_clients(client: Callable[[int], None], n: int) -> float:
    """Run `client(i)` for i in range(n) in n threads at once; the wall seconds until all returned."""
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t0
