"""Global KV store throughput, lookup latency and disk overhead, against a plain-file baseline.

Workload: chunks of 256 tokens of `v41-flash` global KV (256 x 890 B = 227,840 B of random, hence
incompressible, bytes), at least 100 MB per run. Byte model: a write moves one chunk value (payload +
~150 B header + 32 B sha256) into a synced WAL and later one SST; a read moves it once and hashes it.

- store write: GlobalKVStore.put_chunks, 8 chunks per call (one turn of 2K tokens), every chunk its own
  synced write batch (fdatasync) with index entries and audit record.
- store read: GlobalKVStore.longest_valid_prefix over the whole history: lookup, read, checksum.
- baseline ("plain_files"): one file per chunk holding payload + sha256, written then fsync'd (the file
  only; a directory fsync per file, needed for a new name to be durable, would slow it further), read
  back with open/read and the same sha256 check, keeping every payload as the store's read does.
Warm cache (reads follow the writes), median of 5 runs, store and baseline alternating order each run.
Lookup latency: GlobalKVStore.lookup (index only, no payload read) of a session's whole chain at 1K, 32K
and 1M tokens, p50/p99 over repeated calls; the 1M-token chain uses 1 KiB payloads since lookup never
reads them. Disk bytes per token: everything under the store's db directory after close, divided by
the tokens stored, against the 890 B payload per token.

Run: python -m benchmarks.bench_storage [--dir DIR] [--runs 5] [--mb 105] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.hardware import cpu_model, numerics_record
from benchmarks.report import add_json_flag, logs_to_stderr, table_stream, write_json
from storage import GlobalKVStore, MissReason, StoreConfig

TOKENS = 256
BYTES_PER_TOKEN = 890  # v41-flash global KV per token (FP4 codes + scales), from model/'s cache format
PAYLOAD = TOKENS * BYTES_PER_TOKEN
FP = "v41-flash/bench"
CHUNKS_PER_CALL = 8


def _history(n_chunks: int, seed: int) -> list[int]:
    return [(seed * 7_919 + i * 104_729) % 129_280 for i in range(n_chunks * TOKENS)]


def _open(path: Path) -> GlobalKVStore:
    return GlobalKVStore(StoreConfig(path=str(path), capacity_bytes=2**40))


def _store_write(path: Path, history: list[int], payloads: list[bytes]) -> float:
    store = _open(path)
    t0 = time.perf_counter()
    for first in range(0, len(payloads), CHUNKS_PER_CALL):
        chunk_ids = range(first, min(first + CHUNKS_PER_CALL, len(payloads)))
        ranges = {(k * TOKENS, (k + 1) * TOKENS): payloads[k] for k in chunk_ids}
        res = store.put_chunks("bench", "s0", FP, history[: (chunk_ids[-1] + 1) * TOKENS], ranges)
        assert res.persisted, res.refusal
    elapsed = time.perf_counter() - t0
    store.close()
    return elapsed


def _store_read(path: Path, history: list[int], payloads: list[bytes]) -> float:
    store = _open(path)
    store.longest_valid_prefix("bench", FP, history[:TOKENS])  # open cost out of the timing
    t0 = time.perf_counter()
    got = store.longest_valid_prefix("bench", FP, history)
    elapsed = time.perf_counter() - t0
    assert got.miss is None and len(got.payloads) == len(payloads)
    store.close()
    return elapsed


def _file_write(path: Path, payloads: list[bytes]) -> float:
    path.mkdir(parents=True)
    t0 = time.perf_counter()
    for k, payload in enumerate(payloads):
        fd = os.open(path / f"{k:08d}.chunk", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, payload + hashlib.sha256(payload).digest())
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _file_read(path: Path, n: int) -> float:
    # Like the store, hand every verified payload back to the caller (a resume needs them all).
    out: list[memoryview] = []
    t0 = time.perf_counter()
    for k in range(n):
        with open(path / f"{k:08d}.chunk", "rb") as f:
            data = f.read()
        payload, digest = memoryview(data)[:-32], data[-32:]
        assert hashlib.sha256(payload).digest() == digest
        out.append(payload)
    elapsed = time.perf_counter() - t0
    assert len(out) == n
    return elapsed


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _check_correctness(root: Path) -> None:
    """Refuse to benchmark a store that serves wrong or corrupt bytes."""
    path = root / "check"
    store = _open(path)
    hist = _history(3, seed=99)
    pays = {(k * TOKENS, (k + 1) * TOKENS): os.urandom(PAYLOAD) for k in range(3)}
    store.put_chunks("bench", "check", FP, hist, pays)
    got = store.longest_valid_prefix("bench", FP, hist)
    assert got.miss is None and got.payloads == list(pays.values()), "store returned wrong payloads"
    addr = store.lookup("bench", FP, hist).spans[1].address
    value = bytearray(store._db.get(b"C" + addr))
    value[1000] ^= 1
    store._db.put(b"C" + addr, bytes(value))
    got = store.longest_valid_prefix("bench", FP, hist)
    assert got.n_tokens == TOKENS and got.miss.reason == MissReason.CORRUPT, "corruption was served"
    store.close()
    shutil.rmtree(path)


def _lookup_latency(root: Path, n_tokens: int, payload_bytes: int, repeats: int) -> dict[str, float]:
    path = root / f"lookup-{n_tokens}"
    store = _open(path)
    n_chunks = n_tokens // TOKENS
    hist = _history(n_chunks, seed=n_tokens)
    for first in range(0, n_chunks, 64):
        ks = range(first, min(first + 64, n_chunks))
        store.put_chunks(
            "bench",
            "s",
            FP,
            hist[: (ks[-1] + 1) * TOKENS],
            {(k * TOKENS, (k + 1) * TOKENS): os.urandom(payload_bytes) for k in ks},
        )
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = store.lookup("bench", FP, hist)
        times.append(time.perf_counter() - t0)
        assert res.n_tokens == n_chunks * TOKENS
    out = {
        "tokens": n_chunks * TOKENS,
        "chunks": n_chunks,
        "payload_bytes": payload_bytes,
        "lookup_p50_ms": 1e3 * statistics.median(times),
        "lookup_p99_ms": 1e3 * sorted(times)[min(len(times) - 1, int(0.99 * len(times)))],
    }
    if payload_bytes == PAYLOAD:
        reads = []
        for _ in range(5):
            t0 = time.perf_counter()
            got = store.longest_valid_prefix("bench", FP, hist)
            reads.append(time.perf_counter() - t0)
            assert got.miss is None
        out["read_verify_p50_ms"] = 1e3 * statistics.median(reads)
    store.close()
    shutil.rmtree(path)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: system temp)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--mb", type=float, default=105.0, help="MB of payload per run (>= 100 for the record)"
    )
    add_json_flag(parser)
    args = parser.parse_args()
    logs_to_stderr()
    root = Path(tempfile.mkdtemp(prefix="bench_storage_", dir=args.dir))
    try:
        _check_correctness(root)
        n = max(1, int(args.mb * 1e6 // PAYLOAD))
        history = _history(n, seed=1)
        payloads = [os.urandom(PAYLOAD) for _ in range(n)]
        total = n * PAYLOAD
        w_store, w_file, r_store, r_file, disk = [], [], [], [], []
        for run in range(args.runs):
            spath, fpath = root / f"store{run}", root / f"files{run}"
            if run % 2 == 0:
                w_store.append(_store_write(spath, history, payloads))
                w_file.append(_file_write(fpath, payloads))
                r_store.append(_store_read(spath, history, payloads))
                r_file.append(_file_read(fpath, n))
            else:
                w_file.append(_file_write(fpath, payloads))
                w_store.append(_store_write(spath, history, payloads))
                r_file.append(_file_read(fpath, n))
                r_store.append(_store_read(spath, history, payloads))
            disk.append(_disk_bytes(spath / "db"))
            shutil.rmtree(spath)
            shutil.rmtree(fpath)
        mbps = lambda secs: total / statistics.median(secs) / 1e6  # noqa: E731
        lookups = [
            _lookup_latency(root, 1024, PAYLOAD, 200),
            _lookup_latency(root, 32 * 1024, PAYLOAD, 100),
            _lookup_latency(root, 1024 * 1024, 1024, 20),
        ]
        disk_per_token = statistics.median(disk) / (n * TOKENS)
        result = {
            "numerics": numerics_record(),
            "workload": {
                "chunks_per_run": n,
                "payload_bytes_per_chunk": PAYLOAD,
                "payload_mb_per_run": total / 1e6,
            },
            "runs": args.runs,
            "store_write_mb_s": mbps(w_store),
            "file_write_mb_s": mbps(w_file),
            "store_read_mb_s": mbps(r_store),
            "file_read_mb_s": mbps(r_file),
            "write_ratio_vs_file": statistics.median(w_file) / statistics.median(w_store),
            "read_ratio_vs_file": statistics.median(r_file) / statistics.median(r_store),
            "disk_bytes_per_token": disk_per_token,
            "disk_overhead_ratio": disk_per_token / BYTES_PER_TOKEN,
            "lookup": lookups,
            "hardware": {
                "cpu": cpu_model(),
                "cores": os.cpu_count(),
                "python": platform.python_version(),
                "dir": str(root),
            },
        }
        out = table_stream(args.json)
        print(f"{'':24s}{'store':>12s}{'plain files':>14s}{'ratio':>8s}", file=out)
        print(
            f"{'write MB/s (synced)':24s}{result['store_write_mb_s']:12.1f}{result['file_write_mb_s']:14.1f}"
            f"{result['write_ratio_vs_file']:8.2f}",
            file=out,
        )
        print(
            f"{'read MB/s (verified)':24s}{result['store_read_mb_s']:12.1f}{result['file_read_mb_s']:14.1f}"
            f"{result['read_ratio_vs_file']:8.2f}",
            file=out,
        )
        print(
            f"disk bytes/token {disk_per_token:.1f} vs {BYTES_PER_TOKEN} payload "
            f"(x{result['disk_overhead_ratio']:.4f})",
            file=out,
        )
        for row in lookups:
            extra = (
                f"  read+verify p50 {row['read_verify_p50_ms']:.1f} ms" if "read_verify_p50_ms" in row else ""
            )
            print(
                f"lookup {row['tokens']:>8d} tokens: p50 {row['lookup_p50_ms']:.3f} ms  "
                f"p99 {row['lookup_p99_ms']:.3f} ms{extra}",
                file=out,
            )
        write_json(result, args.json)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
