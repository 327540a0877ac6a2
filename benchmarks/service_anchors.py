"""The floors a turn of the service is measured against, in the same process as the service runs:

- a bare grpcio server-streaming no-op RPC (6 messages per call, as a turn's plan + 4 tokens + stats)
  at 1 and 64 concurrent clients over loopback: calls/s and p50 ms;
- one synced SQLite WAL commit of one small row;
- one synced RocksDB batch of one chunk (`chunk_bytes` bytes).

What a turn must pay for durability is about one of each; `turn_floor_ms_c1` is their sum at 1 client.
"""

from __future__ import annotations

import os
import sqlite3
import statistics
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from benchmarks.concurrency import run_clients

__all__ = ["measure_anchors", "measure_turn_floor"]

_METHOD = "/bench.Echo/Stream"
_MESSAGES = 6


def _stream(request: bytes, context: grpc.ServicerContext):
    for _ in range(_MESSAGES):
        yield request


def _grpc_anchor(clients: int, calls_per_client: int) -> dict[str, float]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max(8, clients * 2)))
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Stream": grpc.unary_stream_rpc_method_handler(_stream)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_stream(_METHOD)
    samples: list[float] = []
    lock = threading.Lock()

    def client(_: int) -> None:
        mine = []
        for _ in range(calls_per_client):
            t0 = time.perf_counter()
            for _ in call(b"x" * 64):
                pass
            mine.append(time.perf_counter() - t0)
        with lock:
            samples.extend(mine)

    for _ in range(3):  # warm the channel
        list(call(b"x"))
    wall = run_clients(client, clients)
    channel.close()
    server.stop(None)
    return {"calls_per_s": len(samples) / wall, "p50_ms": statistics.median(samples) * 1e3}


def _sqlite_commit_ms(root: Path, n: int = 40) -> float:
    conn = sqlite3.connect(root / "anchor.sqlite3", isolation_level=None)
    conn.execute("pragma journal_mode=wal")
    conn.execute("pragma synchronous=full")
    conn.execute("create table t (id integer primary key, v blob)")
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.execute("begin immediate")
        conn.execute("insert into t (v) values (?)", (os.urandom(64),))
        conn.execute("commit")
        samples.append(time.perf_counter() - t0)
    conn.close()
    return statistics.median(samples) * 1e3


def _rocks_batch_ms(root: Path, chunk_bytes: int, n: int = 40) -> float:
    db = Rdict(str(root / "anchor-rocks"), Options(raw_mode=True))
    opts = WriteOptions()
    opts.sync = True
    samples = []
    payload = os.urandom(chunk_bytes)
    for i in range(n):
        batch = WriteBatch(raw_mode=True)
        batch.put(i.to_bytes(8, "big"), payload)
        t0 = time.perf_counter()
        db.write(batch, opts)
        samples.append(time.perf_counter() - t0)
    db.close()
    return statistics.median(samples) * 1e3


def measure_turn_floor(chunk_bytes: int, *, calls: int = 200) -> dict[str, Any]:
    """The one-client anchors alone (the bare stream, one synced SQLite commit, one synced RocksDB batch of
    `chunk_bytes`) and `turn_floor_ms_c1`, their sum, as `measure_anchors` reports them."""
    with tempfile.TemporaryDirectory(prefix="kvresume-anchor-") as tmp:
        root = Path(tmp)
        c1 = _grpc_anchor(1, calls)
        sqlite_ms = _sqlite_commit_ms(root)
        rocks_ms = _rocks_batch_ms(root, chunk_bytes)
    return {
        "grpc_stream_c1": c1,
        "sqlite_synced_commit_ms": sqlite_ms,
        "rocksdb_synced_batch_ms": rocks_ms,
        "chunk_bytes": chunk_bytes,
        "turn_floor_ms_c1": c1["p50_ms"] + sqlite_ms + rocks_ms,
    }


def measure_anchors(
    chunk_bytes: int, *, calls_c1: int = 200, calls_per_client_c64: int = 20
) -> dict[str, Any]:
    """The anchors above; `chunk_bytes`: one stored chunk of the served model."""
    floor = measure_turn_floor(chunk_bytes, calls=calls_c1)
    return {**floor, "grpc_stream_c64": _grpc_anchor(64, calls_per_client_c64)}
