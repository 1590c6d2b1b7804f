"""Safetensors read/write with numpy only: no torch, no pickle, bf16 included.

The ``safetensors`` package cannot hand bf16 to numpy, so we parse the format ourselves: an 8-byte
little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``, then raw bytes.
Tensors are returned as read-only views of one ``np.memmap`` per file, so a checkpoint far larger
than RAM can be read tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

from megatrain_jax.hf.json_files import read_json_object

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the reference implementation enforces

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_CODES: dict[np.dtype, str] = {dt: code for code, dt in DTYPES.items()}
# What a model's weights may be stored as: floating point, which a load widens to float32 exactly. An integer or
# boolean tensor (or FP8, which needs its scales) where a weight belongs would be cast to numbers it never meant.
WEIGHT_DTYPES = ("F32", "BF16", "F16", "F64")


class SafetensorsError(ValueError):
    """A safetensors file or checkpoint folder is malformed, truncated or inconsistent."""


def dtype_code(dtype) -> str:
    """The safetensors dtype code (``'BF16'``, ``'F32'``, ...) of a numpy / ml_dtypes dtype."""
    dt = np.dtype(dtype)
    if dt not in _CODES:
        raise SafetensorsError(f"dtype {dt} has no safetensors code; supported: "
                               f"{sorted(str(d) for d in _CODES)}")
    return _CODES[dt]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of the data region
    end: int


class SafetensorsFile:
    """One ``.safetensors`` file: header parsed and validated on open, data memory-mapped lazily."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.metadata, self.tensors, self.data_start = _parse_header(self.path)
        self._mm: np.memmap | None = None

    def get(self, name: str) -> np.ndarray:
        """A read-only array backed by the file (no copy until you convert it)."""
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"tensor {name!r} not in {self.path}")
        if info.begin == info.end:
            return np.zeros(info.shape, DTYPES[info.dtype])
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mm[self.data_start + info.begin:self.data_start + info.end]
        return raw.view(DTYPES[info.dtype]).reshape(info.shape)

    def release(self) -> None:
        """Drop this file's mapping: it is unmapped once no array ``get`` returned is left, and its pages
        leave the process's resident set (a later ``get`` maps the file again)."""
        self._mm = None


    def will_need(self, name: str) -> None:
        """Ask the kernel to start reading the tensor's bytes into the page cache now, without waiting
        (``posix_fadvise(WILLNEED)``), so that a later ``get`` finds them there."""
        info = self.tensors[name]
        if info.end > info.begin and hasattr(os, "posix_fadvise"):
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, self.data_start + info.begin, info.end - info.begin, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


def _parse_header(path: Path) -> tuple[dict[str, str], dict[str, TensorInfo], int]:
    size = path.stat().st_size
    if size < 8:
        raise SafetensorsError(f"{path}: truncated ({size} bytes); a safetensors file starts with an "
                               f"8-byte header length")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: header length {n} bytes is implausible (limit "
                                   f"{_MAX_HEADER_BYTES}); not a safetensors file?")
        if 8 + n > size:
            raise SafetensorsError(f"{path}: truncated: header claims {n} bytes but the file has only "
                                   f"{size - 8} after the length field")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid JSON ({e}); not a safetensors file?") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is a {type(header).__name__}, expected a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_size = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _tensor_info(path, name, entry, data_size)
    spans = sorted((t.begin, t.end, name) for name, t in tensors.items() if t.end > t.begin)
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise SafetensorsError(f"{path}: tensors {n0!r} and {n1!r} overlap (bytes {b1}..{e0})")
    return metadata, tensors, 8 + n


def _tensor_info(path: Path, name: str, entry, data_size: int) -> TensorInfo:
    try:
        code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise SafetensorsError(f"{path}: header entry {name!r} is malformed: {entry!r}") from None
    if code not in DTYPES:
        raise SafetensorsError(f"{path}: tensor {name!r} has dtype {code!r}; supported: {sorted(DTYPES)}")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise SafetensorsError(f"{path}: tensor {name!r} has invalid shape {list(shape)}")
    nbytes = math.prod(shape) * DTYPES[code].itemsize
    if not (isinstance(begin, int) and isinstance(end, int)) or end - begin != nbytes or begin < 0:
        raise SafetensorsError(f"{path}: tensor {name!r} {code}{list(shape)} needs {nbytes} bytes but its "
                               f"data_offsets are [{begin}, {end}]")
    if end > data_size:
        raise SafetensorsError(f"{path}: truncated: tensor {name!r} ends at data byte {end} but the file "
                               f"holds only {data_size} data bytes")
    return TensorInfo(code, shape, begin, end)


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` (a symlink is followed) lies in ``folder``, or in the blob store of a Hugging Face
    cache when ``folder`` is one of its snapshots (``<repo>/snapshots/<revision>``, whose files are links to
    ``<repo>/blobs/<hash>``)."""
    target, home = path.resolve(), folder.resolve()
    if target.parent == home:
        return True
    return home.parent.name == "snapshots" and target.parent == (home.parent.parent / "blobs").resolve()


def _check_shard_name(index: Path, fname: object, tensor: str) -> str:
    """A shard entry of the index must be the plain name of a file in the index's folder: no path."""
    if (not isinstance(fname, str) or fname in ("", ".", "..") or any(c in fname for c in "/\\\0")
            or Path(fname).is_absolute()):
        raise SafetensorsError(f"{index}: refused shard entry {fname!r} (for tensor {tensor!r}): a shard must "
                               f"be the plain name of a file in {index.parent}, with no folder, '..' or absolute "
                               f"path; fix the index's weight_map (e.g. \"model-00001-of-00002.safetensors\")")
    return fname


class Checkpoint:
    """All tensors of a Hugging Face checkpoint folder: ``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``. Each tensor is read only when asked for.

    The index is data from elsewhere: its shard entries must be plain file names in the folder, and no
    weights file may be a symlink leading out of the folder (except, in a Hugging Face cache snapshot, to
    the cache's own blobs). Anything else is refused before it is opened."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        self._where: dict[str, SafetensorsFile] = {}
        single, index = self.dir / SINGLE_FILE, self.dir / INDEX_FILE
        if single.exists():
            self._check_inside(single, single)
            f = SafetensorsFile(single)
            self._where = {name: f for name in f.tensors}
        elif index.exists():
            self._open_index(index)
        else:
            found = sorted(p.name for p in self.dir.iterdir()) if self.dir.is_dir() else None
            hint = ""
            if found and any(n.endswith((".bin", ".pt", ".pth")) for n in found):
                hint = (" Only pickle-based weights are there; we never unpickle: convert them to "
                        "safetensors (e.g. save_pretrained(safe_serialization=True)).")
            raise SafetensorsError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.dir} "
                                   f"(found: {found if found is not None else 'no such folder'}).{hint}")

    def _check_inside(self, path: Path, what: Path | str) -> None:
        if not _inside(path, self.dir):
            raise SafetensorsError(f"{what}: refused {path.name!r}: it is a symlink to {path.resolve()}, outside "
                                   f"the checkpoint folder {self.dir}; copy the file into the folder instead")

    def _open_index(self, index: Path) -> None:
        weight_map = read_json_object(index, SafetensorsError).get("weight_map")
        if weight_map is None:
            raise SafetensorsError(f"{index}: not a valid index: it has no 'weight_map' (tensor name -> shard file "
                                   f"name); take the index again with the shards it lists")
        if not isinstance(weight_map, dict):
            raise SafetensorsError(f"{index}: 'weight_map' must map tensor names to shard file names, got "
                                   f"{type(weight_map).__name__}")
        for name, fname in weight_map.items():  # every entry, before any file is opened
            _check_shard_name(index, fname, name)
        files: dict[str, SafetensorsFile] = {}
        for name, fname in weight_map.items():
            if fname not in files:
                shard = self.dir / fname
                if not shard.is_file():
                    raise SafetensorsError(f"{index}: shard {fname!r} (holding {name!r}) is missing or not a file")
                self._check_inside(shard, f"{index}: shard entry {fname!r} (holding {name!r})")
                files[fname] = SafetensorsFile(shard)
            if name not in files[fname].tensors:
                raise SafetensorsError(f"{index}: says {name!r} is in {fname!r}, but that shard lacks it")
            self._where[name] = files[fname]

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        return self._where[name].tensors[name]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: f.tensors[name].shape for name, f in self._where.items()}

    def dtypes(self) -> dict[str, str]:
        """Each tensor's safetensors dtype code (``'BF16'``, ``'I32'``, ...)."""
        return {name: f.tensors[name].dtype for name, f in self._where.items()}

    def file_of(self, name: str) -> Path:
        """The file that holds tensor ``name``."""
        return self._where[name].path

    def will_need(self, names: Sequence[str]) -> None:
        """Start reading these tensors from the disk in the background (see ``SafetensorsFile.will_need``)."""
        for name in names:
            self._where[name].will_need(name)

    def release(self) -> None:
        """Drop every file's mapping (``SafetensorsFile.release``): for when every tensor has been read."""
        for f in {id(f): f for f in self._where.values()}.values():
            f.release()

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} not in checkpoint {self.dir}")
        return self._where[name].get(name)


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of one file, as memory-mapped read-only arrays."""
    f = SafetensorsFile(path)
    return {name: f.get(name) for name in f.tensors}


# (name, shape, source dtype-independent producer) -> written in the target dtype
Entry = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def write_entries(path: str | os.PathLike, entries: Iterable[Entry], dtype,
                  metadata: Mapping[str, str] | None = None) -> int:
    """Write tensors to one file, converting each to ``dtype`` only when its turn comes (so a part of
    a model at a time is in memory). Returns the bytes of tensor data written."""
    entries = list(entries)
    dt = np.dtype(dtype)
    code = dtype_code(dt)
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape, _ in entries:
        nbytes = math.prod(shape) * dt.itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, produce in entries:
            # one copy at most (the cast, or a transposed view made contiguous), written from its own buffer
            arr = np.asarray(produce()).astype(dt, order="C", copy=False)
            if arr.shape != tuple(shape):
                raise SafetensorsError(f"tensor {name!r}: planned shape {tuple(shape)}, got {arr.shape}")
            f.write(arr.reshape(-1).view(np.uint8))
            del arr
    os.replace(tmp, path)
    return offset


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], dtype=None,
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write arrays to one file, all in ``dtype`` (default: the dtype of the first array)."""
    if not tensors:
        raise SafetensorsError("nothing to write")
    dtype = np.dtype(dtype) if dtype is not None else np.asarray(next(iter(tensors.values()))).dtype
    write_entries(path, [(k, np.shape(v), (lambda v=v: v)) for k, v in tensors.items()], dtype, metadata)


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split of named tensors, in order, into shards of at most ``max_shard_bytes`` (a tensor
    larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def shard_names(n: int) -> list[str]:
    return [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def stale_files(model_dir: Path) -> Iterator[Path]:
    """Weights files a previous save may have left, which would shadow or mix with a new save."""
    for p in model_dir.glob("model*.safetensors*"):
        if p.name in (SINGLE_FILE, INDEX_FILE) or (p.name.startswith("model-") and "-of-" in p.name):
            yield p
