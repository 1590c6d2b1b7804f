"""A checkpoint's manifest: the size and CRC-32 of every file of its array data, written *last*.

Orbax commits a checkpoint by renaming its temporary directory once every item is written, so a save
killed midway leaves no step directory at all. The manifest adds what a rename cannot: a later
truncation, deletion or bit flip of any array file is found before anything is loaded.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Callable

MANIFEST = "MANIFEST.json"
_CHUNK = 16 << 20


def crc32_file(path: Path, progress: Callable[[], None] = lambda: None) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)  # releases the GIL on large buffers: training threads keep running
            progress()
    return crc


def file_entries(directory: Path, checksum: bool = True,
                 progress: Callable[[], None] = lambda: None) -> dict[str, dict[str, int]]:
    """``{relative path: {"size": n, "crc32": c}}`` of every file under ``directory`` (sorted). ``progress()``
    is called after each file and each 16 MiB checksummed (a long pass over a large checkpoint is no stall)."""
    out = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        entry = {"size": path.stat().st_size}
        if checksum:
            entry["crc32"] = crc32_file(path, progress)
        out[path.relative_to(directory).as_posix()] = entry
        progress()
    return out


def write_manifest(directory: Path, entries: dict[str, dict[str, int]], **extra) -> None:
    """Atomically (temporary file, fsync, rename) write ``MANIFEST.json`` into ``directory``."""
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, **extra, "files": entries}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)


def verify_manifest(directory: Path, checksum: bool = True) -> str | None:
    """None when every file listed in the manifest is present with its size (and CRC-32 when
    ``checksum``); otherwise what is wrong, for the warning that names the checkpoint."""
    path = directory / MANIFEST
    if not path.is_file():
        return f"no {MANIFEST} in {directory} (the save did not finish)"
    try:  # JSON of another shape (a list, an entry without its size) is as unreadable as broken JSON
        listed = json.loads(path.read_text())["files"]
        files = {rel: (int(want["size"]), want.get("crc32")) for rel, want in listed.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable {path}: {type(e).__name__}: {e}"
    for rel, (want, crc) in files.items():
        f = directory / rel
        if not f.is_file():
            return f"missing file {f}"
        size = f.stat().st_size
        if size != want:
            return f"{f} has {size} bytes, the manifest says {want} (truncated or overwritten)"
        if checksum and crc is not None and crc32_file(f) != crc:
            return f"{f} fails its CRC-32 check (corrupted)"
    return None
