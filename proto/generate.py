"""Generate the Python modules of proto/kvresume/v1 with the pinned generator (grpcio-tools, dev only).

`python -m proto.generate` writes them into kvresume/v1/, where they are committed.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

__all__ = ["PROTO_FILES", "PROTO_ROOT", "STUBS_DIR", "generate_stubs", "write_stubs"]

PROTO_ROOT = Path(__file__).resolve().parent
# Where the committed modules live (the generated code imports them as `kvresume.v1.<name>_pb2`).
STUBS_DIR = PROTO_ROOT.parent / "kvresume" / "v1"
PROTO_FILES = ("common", "sessions", "admin", "mappers", "models")
# Every file protoc writes for one .proto file.
_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate_stubs(out_dir: Path) -> dict[str, bytes]:
    """Run protoc on the .proto files into `out_dir`.

    Returns:
        file name -> bytes of every generated file.

    Raises:
        RuntimeError: protoc rejected a .proto file.
    """
    from grpc_tools import protoc

    include = str(resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
    ]
    args += [str(PROTO_ROOT / "kvresume" / "v1" / f"{name}.proto") for name in PROTO_FILES]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_ROOT}/kvresume/v1 (see its message above)")
    generated = Path(out_dir) / "kvresume" / "v1"
    return {
        f"{name}{suffix}": (generated / f"{name}{suffix}").read_bytes()
        for name in PROTO_FILES
        for suffix in _SUFFIXES
        if (generated / f"{name}{suffix}").is_file()
    }


def write_stubs() -> Path:
    """Regenerate the committed modules in STUBS_DIR; returns the directory."""
    with tempfile.TemporaryDirectory() as tmp:
        files = generate_stubs(Path(tmp))
    STUBS_DIR.mkdir(parents=True, exist_ok=True)
    for stale in STUBS_DIR.glob("*_pb2*"):
        if stale.is_file() and stale.name not in files:
            stale.unlink()
    for name, data in files.items():
        (STUBS_DIR / name).write_bytes(data)
    shutil.rmtree(STUBS_DIR / "__pycache__", ignore_errors=True)
    return STUBS_DIR


if __name__ == "__main__":
    print(write_stubs(), file=sys.stdout)
