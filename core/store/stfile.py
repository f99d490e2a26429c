"""The safetensors file format, as the file:// store writes and reads it (and http:// uploads).

A safetensors file is an 8-byte little-endian header length N, a JSON header of N bytes (padded
with spaces to a multiple of 8), then the tensors' raw bytes back to back: the header maps each
name to `{"dtype", "shape", "data_offsets": [begin, end]}` relative to the start of the data,
and `"__metadata__"` to a string -> string map. Format reference: the safetensors project's
README ("Format"), version 0.4 and later (the `safetensors` package reads what is written here).

Writers here order tensors by descending element size (then name), so that with the 8-byte
aligned data start every tensor's offset is a multiple of its element size: a reader can view
the bytes of a mapped file as typed tensors in place (zero copy). Files from other writers are
read too; a misaligned tensor is then copied.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from specbus.core.errors import IntegrityError

FORMAT = "specbus-file/1"  # __metadata__["specbus"]: the layout version of files written here
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit

# specbus dtype name (FeatureSpec.dtype) <-> safetensors dtype tag
ST_DTYPES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "uint8": "U8",
    "bool": "BOOL",
}
FROM_ST = {v: k for k, v in ST_DTYPES.items()}
TORCH_OF = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
NAME_OF = {v: k for k, v in TORCH_OF.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its dtype (specbus name), shape and byte range in the data."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """The tensor's byte size in the file."""
        return self.end - self.begin


def order(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Write order: larger elements first, so offsets stay aligned (see module doc)."""
    return sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))


def header_bytes(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[str]]:
    """The length prefix and padded JSON header for `tensors` (CPU, contiguous), and the
    order their bytes must follow."""
    names = order(tensors)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    at = 0
    for name in names:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": ST_DTYPES[NAME_OF[t.dtype]],
            "shape": list(t.shape),
            "data_offsets": [at, at + n],
        }
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, names


def parse_header(prefix: bytes, file_size: int | None = None, where: str = "file"):
    """`(entries, metadata, data_start)` from the first bytes of a file (at least the length
    prefix and the header). Raises IntegrityError for anything that is not a well-formed
    safetensors header, or whose data would run past `file_size` (a truncated file)."""
    if len(prefix) < 8:
        raise IntegrityError(f"{where}: {len(prefix)} bytes, not a safetensors file (short)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES or len(prefix) < 8 + n:
        raise IntegrityError(f"{where}: safetensors header of {n} bytes is cut short or too large")
    try:
        raw = json.loads(prefix[8 : 8 + n])
    except ValueError as e:
        raise IntegrityError(f"{where}: the safetensors header is not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise IntegrityError(f"{where}: the safetensors header is not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    entries: dict[str, Entry] = {}
    end = 0
    try:
        for name, e in raw.items():
            dtype = FROM_ST[e["dtype"]]
            begin, stop = (int(x) for x in e["data_offsets"])
            shape = tuple(int(d) for d in e["shape"])
            numel = 1
            for d in shape:
                numel *= d
            if stop - begin != numel * TORCH_OF[dtype].itemsize or begin < 0:
                raise ValueError(f"tensor {name!r}: byte range {begin}..{stop} != its shape")
            entries[name] = Entry(dtype, shape, begin, stop)
            end = max(end, stop)
    except (KeyError, TypeError, ValueError) as e:
        raise IntegrityError(f"{where}: bad safetensors header entry: {e}") from e
    start = 8 + n
    if file_size is not None and start + end > file_size:
        raise IntegrityError(
            f"{where}: {file_size} bytes, the header says {start + end} (a truncated file)"
        )
    return entries, metadata, start


def read_header(fd: int, file_size: int, where: str = "file"):
    """`parse_header` of an open file (two small preads)."""
    prefix = os.pread(fd, 8, 0)
    if len(prefix) == 8:
        (n,) = struct.unpack("<Q", prefix)
        if n <= MAX_HEADER_BYTES:
            prefix += os.pread(fd, n, 8)
    return parse_header(prefix, file_size, where)


def data_bytes(file_size: int, prefix: bytes) -> int:
    """The tensor bytes of a file (its size minus the length prefix and header)."""
    (n,) = struct.unpack("<Q", prefix[:8])
    return file_size - 8 - n


def view(buffer, entry: Entry, data_start: int) -> torch.Tensor:
    """The tensor `entry` names in `buffer` (a mapped file or bytes): a view where its offset
    is aligned to its element size, else a copy."""
    dtype = TORCH_OF[entry.dtype]
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    offset = data_start + entry.begin
    if offset % dtype.itemsize:
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=entry.nbytes, offset=offset)
        return flat.clone().view(dtype).reshape(entry.shape)
    t = torch.frombuffer(buffer, dtype=dtype, count=entry.nbytes // dtype.itemsize, offset=offset)
    return t.reshape(entry.shape)
