"""The one frozen settings object of the service, loaded from TOML, then environment, then flags.

Knows nothing of the components it configures; migrations/ reads only `database_url` from it.

Precedence (later wins): built-in defaults < TOML file < `KVRESUME_*` environment variables < explicit
overrides (CLI flags). Unknown TOML keys and unknown override names are errors, never ignored.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.child_launcher import CHILD_STARTS
from orchestrator.cpu_split import check_cpu_spec

__all__ = ["Settings", "load_settings", "SETTINGS_VERSION"]

SETTINGS_VERSION = 1
_ENV_PREFIX = "KVRESUME_"
_MIB = 1024 * 1024


def _default_pool_budget() -> int:
    # ARCHITECTURE §4: the window pool defaults to 10% of host RAM.
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * 1024 * _MIB
    return max(total // 10, 64 * _MIB)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Service configuration.

    Tenant tokens map a bearer token's tenant name to the token; the admin token authorises Admin calls
    and mapper registration. Tokens are secrets: `__repr__` hides them.
    """

    version: int = SETTINGS_VERSION
    data_dir: Path = Path("data")
    # Empty means "a SQLite file inside data_dir" (see `resolved_database_url`).
    database_url: str = ""
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50051
    # Port 0 binds any free port (tests); metrics_enabled=False serves no /metrics at all.
    # 50052, beside gRPC's 50051: 9090 is Prometheus's own port (and LMCache's), taken where one runs.
    metrics_port: int = 50052
    metrics_enabled: bool = True
    # The OpenAI-compatible HTTP API (orchestrator/http/) on grpc_host; 0: not served. Callers of
    # `start_http_server` may bind port 0 (any free port) directly.
    http_port: int = 0
    region: str = "local"
    # This node's name in the registry (which store holds a session's cache); empty: the host name.
    node_name: str = ""
    tenant_tokens: Mapping[str, str] = field(default_factory=dict, repr=False)
    admin_token: str = field(default="", repr=False)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    max_request_bytes: int = 4 * _MIB
    max_turn_tokens: int = 131072
    max_new_tokens: int = 8192
    max_sessions_per_tenant: int = 10000
    pool_budget_bytes: int = field(default_factory=_default_pool_budget)
    pool_ttl_s: float = 600.0
    # Decoded global KV kept beside pool entries so a full hit skips dequantizing the history
    # (orchestrator/engine/decoded_states.py); 0 disables it.
    decoded_state_budget_bytes: int = 256 * _MIB
    retention_floor_s: float = 72 * 3600.0
    retention_ceiling_s: float = 30 * 24 * 3600.0
    calibration_file: Path | None = None
    # The gRPC server: "threads" (grpc's thread-pool server: each stream holds a worker for its whole
    # turn) or "async" (grpc.aio on an event loop thread: a turn waiting for the scheduler holds no
    # thread, orchestrator/api/async_steps.py). Opt-in: it passes the whole suite but costs more per turn
    # on 2 cores (orchestrator/README.md, threading model).
    grpc_server: str = "threads"
    # Worker threads. "async": they run the RPCs' blocking stretches (registry, store, sampling) and the
    # other methods; "threads": they serve RPCs, a turn's thread waiting on the scheduler between steps,
    # so there must be about as many as concurrent streams (admission below refuses the rest).
    grpc_workers: int = 128
    # Served models: name -> "checkpoint:<dir>" or "random:<preset | config.json>[@seed]"; empty: the
    # sibling family (shipped checkpoints when present, else labelled random-init stand-ins).
    served_models: Mapping[str, str] = field(default_factory=dict)
    # Tokens per stored global-KV chunk (a multiple of every served model's compression ratios).
    kv_chunk_tokens: int = 256
    kv_capacity_bytes: int = 100 * 1024 * _MIB
    # Intra-op threads for model compute (0: every core); set by the entry point, once per process. Not
    # part of the numerics profile: exports are byte-identical at 1 and 2 threads (model/README.md).
    torch_threads: int = 0
    # The served models' CPU code path: "portable" (the pinned AVX2 profile of the conformance vectors,
    # applied by `kvresume serve` before torch loads), "strict" (the same with MKL's strict CNR mode, for
    # CPUs where portable's GEMMs depend on the row count), "native" (the caller's environment) or "auto"
    # (portable where its GEMM probe passes, else strict: orchestrator/numerics_env.resolve_cpu_path).
    # Part of the caches' numerics fingerprint: caches written under another one are misses.
    model_numerics: str = "auto"
    # Where served models run ("cpu", "cuda", "cuda:1"); part of the caches' numerics fingerprint.
    model_device: str = "cpu"
    # Kernels of the served models: "torch" (reference ops) or "triton" (CUDA kernels); the two give
    # caches that are not bit-for-bit interchangeable, so it is part of the numerics fingerprint too.
    model_kernel_backend: str = "torch"
    # The served models' quantized-linear math: "exact" (the reference's block-scaled GEMMs, bit for bit
    # the conformance vectors) or "fast" (scales folded into cached weights, one GEMM per linear: faster,
    # not bitwise the reference; drift measured in model/README.md). Part of the caches' numerics
    # fingerprint, so a cache written under one is a miss under the other.
    model_math: str = "exact"
    # How turns share a served model: "batching" (one scheduler per model runs every session's decode
    # token in one batch-invariant pass per step, plus prefill chunks under `step_token_budget`) or
    # "serial" (each forward pass alone, one at a time: the baseline). Both give identical tokens and bytes.
    scheduler: str = "batching"
    # Where the served models compute: "separate" (a model process of their own,
    # orchestrator/model_process/: the model's ops and the service's Python then do not share one GIL;
    # this process keeps the models' fingerprints, not their weights) or "inline" (in this process).
    # Same tokens and bytes either way (the model process's fingerprints are checked). Default separate
    # since session 16: orchestrator/README.md, "The model process", has the measurements.
    model_process: str = "separate"
    # CPUs of the model process (with model_process = "separate"), applied by `kvresume serve` and the
    # benchmarks, never by a library call: "auto" (models on the CPU, Linux, two or more CPUs: the
    # service's process keeps the first quarter of them, at least one, and the model process the rest, at
    # most one per model thread; on an accelerator no pinning), "none" (no pinning), or the model process's
    # CPUs as Linux writes them ("3", "2-3"), the service keeping the others. Measured: 64 sessions on 2
    # CPUs, 82-85 -> 102-107 turns/s (orchestrator/cpu_split.py).
    model_process_cpus: str = "auto"
    # Tune the garbage collector of `kvresume serve`'s process and of its model process for serving once
    # they are ready (orchestrator/heap.py): the start-up heap frozen (`gc.freeze`), so that the
    # collector's full passes no longer walk its objects (torch, SQLAlchemy, grpc; about 250,000), each
    # of which stopped every thread for 130-205 ms under load; and the youngest generation collected every
    # 20,000 new objects instead of 700. Off: CPython's defaults, at the price of those pauses.
    tune_gc: bool = True
    # Where a turn's registry transaction runs on a SQLite file registry: "inline" (in the turn's own
    # thread) or "process" (the registry writer process, orchestrator/registry_writer/, while two or more
    # turns run: the transaction holds SQLite's one write lock, and in this process each of its statements
    # waited for the GIL behind the turns' and gRPC's threads; 10-16% more no-op turns/s at 64 sessions).
    # The default again since session 25 (opt-in at the end of session 24 over a chaos test's oracle,
    # orchestrator/README.md, "The registry writer process"). PostgreSQL and in-memory SQLite registries
    # always run it inline. Same rows either way (tests/orchestrator/engine/test_finish_on_connection.py).
    registry_writer: str = "process"
    # How the model process and the registry writer process start: "preloaded" (forked from a launcher
    # process that has already imported them, orchestrator/child_launcher.py: a model process then skips
    # torch's import, about 1.5 s of its 2.1 s to ready on the 2-vCPU VMs, at the price of the idle
    # launcher's memory, about 250 MB) or "exec" (`python -m`, every import afresh). Same processes
    # either way; "preloaded" falls back to "exec" where no launcher can start.
    child_start: str = "preloaded"
    # Most sequences decoded in one step, and prompt tokens (prefill/replay chunks) run per step (also
    # the prefill chunk size; 512 measured against 256 in orchestrator/README.md, "Many sessions at once").
    max_batch_sequences: int = 64
    step_token_budget: int = 512
    # Turns admitted at once per model (running or waiting for a step); past it RESOURCE_EXHAUSTED.
    max_running_turns: int = 96
    # Mapper fitting jobs (orchestrator/jobs/): jobs fitting at once, jobs waiting beyond them (past both,
    # StartFit is RESOURCE_EXHAUSTED), torch threads of each job's child process (so fitting never takes
    # the cores turns are served on), and the most calibration tokens one job may ask for.
    fit_max_running_jobs: int = 1
    fit_max_queued_jobs: int = 8
    fit_threads: int = 1
    fit_max_budget_tokens: int = 4_000_000
    # A file holding the audit anchor key (at least 16 bytes; never stored in SQL or the store): with
    # it the node writes HMAC anchors of every audit chain head every `audit_anchor_interval_s`, to the
    # store and to `data_dir/audit-anchors/<node>.jsonl`, and audit verify checks them. Unset: audit
    # verify says "unanchored", since a cut or re-forged chain then passes every other check.
    audit_anchor_key_file: Path | None = None
    audit_anchor_interval_s: float = 60.0
    # Chunks the store holds without any registry row (a turn that never committed) are deleted once
    # older than this, by a sweep at start-up and every min(orphan_grace_s, 600) s while serving.
    orphan_grace_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.version != SETTINGS_VERSION:
            raise ValueError(f"settings version {self.version} is not supported (want {SETTINGS_VERSION})")
        for name in ("grpc_port", "metrics_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name}={port} is not a TCP port")
        for name in (
            "max_request_bytes",
            "max_turn_tokens",
            "max_new_tokens",
            "max_sessions_per_tenant",
            "pool_budget_bytes",
            "grpc_workers",
            "kv_chunk_tokens",
            "kv_capacity_bytes",
            "max_batch_sequences",
            "step_token_budget",
            "max_running_turns",
            "fit_max_running_jobs",
            "fit_threads",
            "fit_max_budget_tokens",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.fit_max_queued_jobs < 0:
            raise ValueError(f"fit_max_queued_jobs={self.fit_max_queued_jobs} must be >= 0")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads={self.torch_threads} must be >= 0")
        if not (math.isfinite(self.orphan_grace_s) and self.orphan_grace_s >= 0):
            raise ValueError(f"orphan_grace_s={self.orphan_grace_s} must be finite and >= 0")
        if not (math.isfinite(self.audit_anchor_interval_s) and self.audit_anchor_interval_s > 0):
            raise ValueError(f"audit_anchor_interval_s={self.audit_anchor_interval_s} must be finite and > 0")
        if self.decoded_state_budget_bytes < 0:
            raise ValueError(
                f"decoded_state_budget_bytes={self.decoded_state_budget_bytes} must be >= 0 (0 disables)"
            )
        if self.pool_ttl_s <= 0:
            raise ValueError(f"pool_ttl_s={self.pool_ttl_s} must be positive")
        if self.retention_floor_s < 0 or self.retention_ceiling_s <= 0:
            raise ValueError(
                f"retention floor {self.retention_floor_s} must be >= 0 and "
                f"ceiling {self.retention_ceiling_s} must be > 0"
            )
        if not self.region:
            raise ValueError("region must be a non-empty label")
        # Transformer's backends, spelled out: settings stays free of torch (migrations/ imports it).
        if self.model_kernel_backend not in ("torch", "triton"):
            raise ValueError(
                f"model_kernel_backend={self.model_kernel_backend!r} must be 'torch' or 'triton'"
            )
        # numerics_env.CPU_PATH_CHOICES, spelled out for the same reason.
        if self.model_numerics not in ("auto", "portable", "strict", "native"):
            raise ValueError(
                f"model_numerics={self.model_numerics!r} must be 'auto', 'portable', 'strict' or 'native'"
            )
        # model.numerics.MATH_MODES, spelled out for the same reason.
        if self.model_math not in ("exact", "fast"):
            raise ValueError(f"model_math={self.model_math!r} must be 'exact' or 'fast'")
        if self.scheduler not in ("batching", "serial"):
            raise ValueError(f"scheduler={self.scheduler!r} must be 'batching' or 'serial'")
        if self.grpc_server not in ("async", "threads"):
            raise ValueError(f"grpc_server={self.grpc_server!r} must be 'async' or 'threads'")
        if self.model_process not in ("inline", "separate"):
            raise ValueError(f"model_process={self.model_process!r} must be 'inline' or 'separate'")
        check_cpu_spec(self.model_process_cpus)
        if self.registry_writer not in ("inline", "process"):
            raise ValueError(f"registry_writer={self.registry_writer!r} must be 'inline' or 'process'")
        if self.child_start not in CHILD_STARTS:
            raise ValueError(f"child_start={self.child_start!r} must be one of {', '.join(CHILD_STARTS)}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                f"TLS needs both a certificate and a key (cert={self.tls_cert_file}, key={self.tls_key_file})"
            )
        tokens = list(self.tenant_tokens.values())
        if any(not t for t in tokens) or len(set(tokens)) != len(tokens):
            raise ValueError("tenant tokens must be non-empty and distinct")
        if self.admin_token and self.admin_token in tokens:
            raise ValueError("the admin token must differ from every tenant token")
        # A frozen dataclass may still hold a caller's mutable dict; copy it so nobody mutates ours.
        object.__setattr__(self, "tenant_tokens", dict(self.tenant_tokens))
        object.__setattr__(self, "served_models", dict(self.served_models))

    @property
    def resolved_database_url(self) -> str:
        """The SQLAlchemy URL: `database_url`, or a SQLite file `registry.sqlite3` in `data_dir`."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'registry.sqlite3').resolve()}"

    @property
    def resolved_node_name(self) -> str:
        return self.node_name or socket.gethostname()

    @property
    def audit_anchor_file(self) -> Path:
        """This node's append-only anchor file."""
        return self.data_dir / "audit-anchors" / f"{self.resolved_node_name}.jsonl"

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def grpc_address(self) -> str:
        return f"{self.grpc_host}:{self.grpc_port}"


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_PATH_FIELDS = {"data_dir", "tls_cert_file", "tls_key_file", "calibration_file", "audit_anchor_key_file"}
_INT_FIELDS = {
    "version",
    "grpc_port",
    "metrics_port",
    "http_port",
    "max_request_bytes",
    "max_turn_tokens",
    "max_new_tokens",
    "max_sessions_per_tenant",
    "pool_budget_bytes",
    "decoded_state_budget_bytes",
    "grpc_workers",
    "kv_chunk_tokens",
    "kv_capacity_bytes",
    "torch_threads",
    "max_batch_sequences",
    "step_token_budget",
    "max_running_turns",
    "fit_max_running_jobs",
    "fit_max_queued_jobs",
    "fit_threads",
    "fit_max_budget_tokens",
}
_BOOL_FIELDS = {"metrics_enabled", "tune_gc"}
_FLOAT_FIELDS = {"pool_ttl_s", "retention_floor_s", "retention_ceiling_s", "audit_anchor_interval_s",
                 "orphan_grace_s"}


def _coerce(name: str, value: Any) -> Any:
    if name in _PATH_FIELDS:
        return None if value in (None, "") else Path(value)
    if name in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"setting {name}={value!r} must be an integer")
        return int(value)
    if name in _FLOAT_FIELDS:
        return float(value)
    if name in _BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ValueError(f"setting {name}={value!r} must be a boolean")
    if name in ("tenant_tokens", "served_models"):
        if isinstance(value, str):
            return _parse_token_list(value)
        if not isinstance(value, Mapping):
            raise ValueError(f"setting {name} must be a table of name = value, got {value!r}")
        return {str(k): str(v) for k, v in value.items()}
    if not isinstance(value, str):
        raise ValueError(f"setting {name}={value!r} must be a string")
    return value


def _parse_token_list(text: str) -> dict[str, str]:
    # Environment form: "tenant-a=token1,tenant-b=token2".
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        tenant, sep, token = item.partition("=")
        if not sep or not tenant or not token:
            raise ValueError(f"tenant token entry {item.split('=')[0]!r}=... must look like tenant=token")
        out[tenant] = token
    return out


def load_settings(
    *,
    toml_path: Path | str | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build Settings from defaults, a TOML file, `KVRESUME_*` environment variables and overrides.

    Args:
        toml_path: a TOML file with top-level keys named like the Settings fields; `None` reads
            `KVRESUME_CONFIG` from the environment when set.
        environ: the environment to read (default `os.environ`); `KVRESUME_DATABASE_URL` sets
            `database_url`, `KVRESUME_TENANT_TOKENS` takes `tenant=token,tenant2=token2`.
        overrides: values from CLI flags; `None` values are skipped so unset flags change nothing.

    Raises:
        ValueError: an unknown key, a value of the wrong type, or an invalid combination.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = toml_path if toml_path is not None else env.get(_ENV_PREFIX + "CONFIG") or None
    if path is not None:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
        unknown = sorted(set(raw) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown settings keys in {path}: {unknown}")
        values.update({k: _coerce(k, v) for k, v in raw.items()})
    for name in _FIELDS:
        key = _ENV_PREFIX + name.upper()
        if key in env:
            values[name] = _coerce(name, env[key])
    for name, value in (overrides or {}).items():
        if name not in _FIELDS:
            raise ValueError(f"unknown setting override {name!r}")
        if value is not None:
            values[name] = _coerce(name, value)
    return Settings(**values)
