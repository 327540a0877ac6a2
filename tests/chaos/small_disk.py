"""A small filesystem for disk-full runs: a tmpfs when mounting is allowed, else an ext4 loop file;
`None` with the reason when neither is available (the test then skips and says why)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def small_disk(where: Path, size_mib: int) -> Iterator[tuple[Path | None, str]]:
    """Yield (mount point, how) or (None, why not); unmounts on exit."""
    mnt = where / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    how = ""
    if shutil.which("mount") is None:
        yield None, "no mount(8) on this machine"
        return
    tried = _run("mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt))
    if tried.returncode == 0:
        how = f"tmpfs {size_mib} MiB"
    elif shutil.which("mkfs.ext4") is not None:
        image = where / "disk.img"
        with image.open("wb") as f:
            f.truncate(size_mib << 20)
        made = _run("mkfs.ext4", "-q", "-F", str(image))
        looped = _run("mount", "-o", "loop", str(image), str(mnt)) if made.returncode == 0 else made
        if looped.returncode != 0:
            why = f"cannot mount a tmpfs ({tried.stderr.strip()}) or a loop file ({looped.stderr.strip()})"
            yield None, why
            return
        how = f"ext4 loop file {size_mib} MiB"
    else:
        yield None, f"cannot mount a tmpfs ({tried.stderr.strip()}) and no mkfs.ext4 for a loop file"
        return
    try:
        yield mnt, how
    finally:
        _run("umount", "-l", str(mnt))


def fill(path: Path, *, chunk: int = 1 << 20) -> int:
    """Write `path` until the filesystem is full; returns the bytes written."""
    written = 0
    block = b"\0" * chunk
    with path.open("wb", buffering=0) as f:
        while True:
            try:
                n = f.write(block[:chunk])
            except OSError:
                if chunk <= 4096:
                    break
                chunk = 4096
                continue
            written += n or 0
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())
    return written
