"""Generated protobuf/gRPC stubs of proto/kvresume/v1, built on first use into orchestrator/_generated/.

The stubs are build output (git-ignored, never edited): `load_stubs()` runs grpc_tools.protoc when the
.proto files or the generator version changed since the last build, then imports the modules.
`python -m orchestrator.api.stubs` builds them ahead of time.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import ModuleType

__all__ = ["Stubs", "load_stubs", "build_stubs", "PROTO_ROOT", "GENERATED_DIR"]

_REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = _REPO / "proto"
GENERATED_DIR = Path(__file__).resolve().parents[1] / "_generated"
_PROTO_FILES = ("common", "sessions", "admin", "mappers")
_STAMP = "STAMP"


@dataclass(frozen=True, kw_only=True)
class Stubs:
    """The generated modules: messages (`*_pb2`) and services (`*_pb2_grpc`)."""

    common: ModuleType
    sessions: ModuleType
    sessions_grpc: ModuleType
    admin: ModuleType
    admin_grpc: ModuleType
    mappers: ModuleType
    mappers_grpc: ModuleType

    @property
    def service_names(self) -> tuple[str, ...]:
        """Full names of our services, for reflection and health."""
        return tuple(
            module.DESCRIPTOR.services_by_name[name].full_name
            for module, name in (
                (self.sessions, "Sessions"),
                (self.admin, "Admin"),
                (self.mappers, "Mappers"),
            )
        )


def _stamp() -> str:
    import grpc_tools

    digest = hashlib.sha256()
    digest.update(getattr(grpc_tools, "__version__", "unknown").encode())
    for name in _PROTO_FILES:
        digest.update((PROTO_ROOT / "kvresume" / "v1" / f"{name}.proto").read_bytes())
    return digest.hexdigest()


def build_stubs(force: bool = False) -> Path:
    """Generate the stubs into GENERATED_DIR unless they are current; returns the directory.

    Raises:
        RuntimeError: protoc rejected a .proto file.
    """
    from grpc_tools import protoc

    stamp = _stamp()
    stamp_file = GENERATED_DIR / _STAMP
    if not force and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return GENERATED_DIR
    GENERATED_DIR.parent.mkdir(parents=True, exist_ok=True)
    # The lock lives outside the repository so that it never shows up as an untracked file.
    key = hashlib.sha256(str(GENERATED_DIR).encode()).hexdigest()[:16]
    lock_path = Path(tempfile.gettempdir()) / f"kvresume-stubs-{key}.lock"
    with open(lock_path, "w") as lock:
        # Two processes importing at once must not interleave their builds.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and stamp_file.is_file() and stamp_file.read_text() == stamp:
            return GENERATED_DIR
        include = str(resources.files("grpc_tools") / "_proto")
        with tempfile.TemporaryDirectory(dir=GENERATED_DIR.parent, prefix="._generated.") as tmp:
            args = [
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"-I{include}",
                f"--python_out={tmp}",
                f"--grpc_python_out={tmp}",
                f"--pyi_out={tmp}",
            ]
            args += [str(PROTO_ROOT / "kvresume" / "v1" / f"{name}.proto") for name in _PROTO_FILES]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {PROTO_ROOT}/kvresume/v1 (see its message above)")
            Path(tmp, _STAMP).write_text(stamp)
            if GENERATED_DIR.exists():
                shutil.rmtree(GENERATED_DIR)
            Path(tmp).rename(GENERATED_DIR)
            # TemporaryDirectory's cleanup tolerates the directory having been moved away.
            Path(tmp).mkdir()
    return GENERATED_DIR


def load_stubs() -> Stubs:
    """Build the stubs if needed and import them (the generated code imports `kvresume.v1.*`)."""
    directory = str(build_stubs())
    if directory not in sys.path:
        sys.path.insert(0, directory)
    mods = {name: importlib.import_module(f"kvresume.v1.{name}_pb2") for name in _PROTO_FILES}
    grpcs = {name: importlib.import_module(f"kvresume.v1.{name}_pb2_grpc") for name in _PROTO_FILES[1:]}
    return Stubs(
        common=mods["common"],
        sessions=mods["sessions"],
        sessions_grpc=grpcs["sessions"],
        admin=mods["admin"],
        admin_grpc=grpcs["admin"],
        mappers=mods["mappers"],
        mappers_grpc=grpcs["mappers"],
    )


if __name__ == "__main__":
    print(build_stubs(force="--force" in sys.argv))
