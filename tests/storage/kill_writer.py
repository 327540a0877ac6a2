"""Child process of the durability tests: writes chunks in a loop and prints `ACK i` after each
put_chunks returned, so the parent knows which writes were acknowledged before it kills us.

Usage: python -m tests.storage.kill_writer STORE_PATH N_PUTS PAYLOAD_BYTES
"""

from __future__ import annotations

import hashlib
import sys

from storage import GlobalKVStore, StoreConfig

CHUNK = 8
FP = "kill-test-fp"


def history(i: int) -> list[int]:
    """Two full chunks and a 3-token tail, distinct per i."""
    return [i * 1000 + j for j in range(2 * CHUNK + 3)]


def payload(i: int, start: int, size: int) -> bytes:
    seed = hashlib.sha256(f"{i}:{start}".encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def payloads(i: int, size: int) -> dict[tuple[int, int], bytes]:
    return {
        (s, e): payload(i, s, size) for s, e in ((0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, 2 * CHUNK + 3))
    }


def main() -> None:
    path, n_puts, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = GlobalKVStore(StoreConfig(path=path, chunk_tokens=CHUNK, compression_ratios=(4,)))
    for i in range(n_puts):
        res = store.put_chunks("tenant", f"s{i}", FP, history(i), payloads(i, size))
        assert res.persisted, res.refusal
        sys.stdout.write(f"ACK {i}\n")
        sys.stdout.flush()
    store.close()


if __name__ == "__main__":
    main()
