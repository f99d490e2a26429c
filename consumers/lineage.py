"""The lineage file: every trained sample id in training order, beside the checkpoints.

A run of weeks trains tens of millions of samples, so the lineage is not held in memory nor
in each checkpoint: rank 0 appends the ids trained since the last checkpoint to
`<checkpoint dir>/lineage.jsonl` (one JSON string per line) when it writes a checkpoint, and
the checkpoint records how much of the file is its lineage (`{"file", "count", "bytes"}`: the
first `count` lines, `bytes` long). A checkpoint's lineage is that prefix, so a kill between
the append and the checkpoint's rename leaves extra lines the next save cuts off (it truncates
to its base first), and a resume from an older checkpoint rewrites what follows it.

`read_lineage(step_dir)` / `load_state(step_dir)` are how tools and tests read a checkpoint's
lineage (chaos checks, the pipeline tests' exactly-once assertions); a checkpoint of an older
specbus, whose `lineage` is the list itself, reads the same.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from specbus.core.errors import CheckpointError

LINEAGE_FILE = "lineage.jsonl"


def line_of(sample_id: str) -> bytes:
    """One id's line in the file (its length is what the ledger counts as bytes)."""
    return orjson.dumps(sample_id) + b"\n"


def append(path: Path, base_bytes: int, ids: list[str]) -> int:
    """Cut the file at `base_bytes` (what the checkpoint before holds), append `ids`, fsync.
    Returns the file's length after. Raises `CheckpointError` when the file is shorter than
    `base_bytes` (the lineage of the checkpoint being continued is gone)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size < base_bytes:
            raise CheckpointError(
                f"{path} holds {size} bytes, the checkpoint being continued counts {base_bytes}: "
                "its lineage file was cut or replaced"
            )
        os.ftruncate(fd, base_bytes)
        os.lseek(fd, base_bytes, os.SEEK_SET)
        data = b"".join(line_of(i) for i in ids)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        return base_bytes + len(data)
    finally:
        os.close(fd)


def iter_ids(path: Path, count: int, nbytes: int) -> Iterator[str]:
    """The first `count` ids of the file (`nbytes` long), streamed. Raises `CheckpointError`
    when the file does not hold them."""
    if count == 0:
        return
    try:
        f = open(path, "rb")  # noqa: SIM115 - a generator's file, closed below
    except OSError as e:
        raise CheckpointError(f"lineage file {path} cannot be read: {e}") from e
    n, left = 0, nbytes
    with f:
        for line in f:
            left -= len(line)
            if left < 0 or not line.endswith(b"\n"):
                break
            yield orjson.loads(line)
            n += 1
            if n == count:
                return
    raise CheckpointError(f"lineage file {path} holds {n} of the {count} ids its checkpoint counts")


def lineage_of(state: dict[str, Any], directory: Path) -> list[str]:
    """The lineage of a checkpoint's state: read from the file beside the checkpoints
    (`directory`), or the list an older checkpoint holds itself."""
    lin = state.get("lineage")
    if isinstance(lin, list):
        return list(lin)
    if not isinstance(lin, dict):
        return []
    return list(iter_ids(directory / lin["file"], int(lin["count"]), int(lin["bytes"])))


def load_state(step_dir: str | Path) -> dict[str, Any]:
    """A checkpoint's `state.pt` with `lineage` read into a list (tools and tests; a trainer
    never holds the whole lineage)."""
    import torch

    step_dir = Path(step_dir)
    state = torch.load(step_dir / "state.pt", map_location="cpu", weights_only=False)
    state["lineage"] = lineage_of(state, step_dir.parent)
    return state


def read_lineage(step_dir: str | Path) -> list[str]:
    """The sample ids a checkpoint holds, in training order."""
    return load_state(step_dir)["lineage"]
