"""The feeder: a dataset -> PromptTasks on the run's TASKS stream, once, in a seeded order.

`prepare(cfg)` tokenises the training records and derives the vocab mapping; `feed(...)`
writes the run `Manifest`, publishes one task per record per epoch (permutation seeded by
`data.seed + epoch`, bounded by the producers' lag), then marks the feed complete. A restart
resumes after the last task published; a manifest of another plan is refused.
docs/architecture.md, "Feeder".
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from specbus.bus.publisher import check_payload_sizes, encode
from specbus.bus.replay import last
from specbus.bus.run import RunBus
from specbus.bus.subjects import PRODUCERS
from specbus.core.config import DataConfig, RunConfig
from specbus.core.contracts import Manifest, ManifestTarget, PromptTask, VocabTable
from specbus.core.data.datasets import StreamedSplit, iter_source
from specbus.core.data.packed import PackedSamples
from specbus.core.data.tokenize import TokenizedSample, tokenize_records
from specbus.core.data.vocab import VocabMapping, build_vocab_mapping, count_tokens
from specbus.core.errors import ConfigError, RecordError
from specbus.core.models.target import (
    TargetInfo,
    load_target_info,
    load_tokenizer,
    resolve_target_dir,
    target_fingerprint,
    tokenizer_fingerprint,
)
from specbus.core.telemetry import span

log = logging.getLogger("specbus.feeder")


@dataclass
class Prepared:
    """The feeder's tokenised training samples, held-back records, vocab mapping and the target's
    identity."""

    samples: PackedSamples  # a sequence of TokenizedSample, in flat buffers
    holdout: list[dict[str, Any]]
    vocab: VocabMapping
    info: TargetInfo
    target_path: Path
    tokenizer: Any
    target_fingerprint: str
    tokenizer_fingerprint: str


def _has_tokenizer(path: Path) -> bool:
    return any(
        (path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )


def max_tokens_of(cfg: RunConfig, info: TargetInfo) -> tuple[int, str]:
    """The run's longest sample and the setting that bounds it: `data.max_length`, or the
    target's context when that is shorter (`target.context_length`, else its config's
    `max_position_embeddings`)."""
    context = cfg.target.context_length or info.max_position_embeddings
    if cfg.data.max_length <= context:
        return cfg.data.max_length, "data.max_length"
    key = "target.context_length" if cfg.target.context_length else "the target's context"
    return context, key


def _pretokenised(records: Iterable[dict], model: str) -> Iterator[dict]:
    """`records`, each checked to carry its `input_ids` (a target without a tokenizer)."""
    for record in records:
        if "input_ids" not in record:
            raise ConfigError(
                f"target {model!r} has no tokenizer: data.source must be pre-tokenised (input_ids)"
            )
        yield record


def prepare(cfg: RunConfig) -> Prepared:
    """Load, split, tokenise; build the vocab mapping. Raises ConfigError on unusable data.
    Records over the run's maximum (`max_tokens_of`) are skipped (one warning), truncated, or
    refused with `SampleTooLong` before anything is fed, by `data.over_length`."""
    path = resolve_target_dir(cfg.target.model)
    info = load_target_info(path, name=cfg.target.model)
    tokenizer = load_tokenizer(path) if _has_tokenizer(path) else None
    # The records stream from the source into the packed samples: only the held-back ones
    # are kept (a 10 M-record JSONL is ~6 GB of record objects, its packed tokens a fraction).
    split = StreamedSplit(iter_source(cfg.data.source), cfg.data.holdout, cfg.data.limit)
    train = iter(split) if tokenizer is not None else _pretokenised(split, cfg.target.model)
    max_tokens, key = max_tokens_of(cfg, info)
    samples = tokenize_records(train, tokenizer, cfg.data, max_tokens=max_tokens, key=key,
                               source=f"data.source {cfg.data.source!r}",
                               collect=PackedSamples)  # fmt: skip
    num_train, holdout = split.given, split.held
    if not samples:
        raise ConfigError(
            f"data.source {cfg.data.source!r}: no record has a supervised (assistant) token"
        )
    dropped = num_train - len(samples)
    if dropped:
        log.warning(
            "dropped %d of %d records with fewer than 2 supervised tokens", dropped, num_train
        )
    draft_vocab = min(cfg.strategy.draft.draft_vocab_size, info.vocab_size)
    vocab = build_vocab_mapping(
        count_tokens((s.input_ids, s.loss_mask) for s in samples), draft_vocab, info.vocab_size
    )
    return Prepared(
        samples=samples,
        holdout=holdout,
        vocab=vocab,
        info=info,
        target_path=path,
        tokenizer=tokenizer,
        target_fingerprint=target_fingerprint(path, cfg.target.quantize),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer) if tokenizer is not None else "none",
    )


def epoch_order(num: int, seed: int, epoch: int) -> list[int]:
    """The dataset indices of one epoch, in a permutation that depends only on (seed, epoch)."""
    order = list(range(num))
    random.Random(f"specbus:{seed}:{epoch}").shuffle(order)
    return order


def plan_of(cfg: RunConfig, prepared: Prepared) -> dict[str, Any]:
    """What every process of the run must agree on (the manifest's identity)."""
    return {
        "strategy": cfg.strategy.model_dump(mode="json"),
        "data": cfg.data.model_dump(mode="json"),
        "target": {"model": cfg.target.model, "fingerprint": prepared.target_fingerprint},
        "num_samples": len(prepared.samples),
        "vocab": prepared.vocab.fingerprint(),
    }


def plan_hash(plan: dict[str, Any]) -> str:
    """A short stable digest of a plan (sorted-key JSON)."""
    return hashlib.sha256(orjson.dumps(plan, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def manifest_of(cfg: RunConfig, prepared: Prepared) -> Manifest:
    """The run's manifest: its plan (see `plan_of`), task count, target and vocab table."""
    return build_manifest(cfg, prepared, plan_of(cfg, prepared),
                          planned_tasks=len(prepared.samples) * cfg.data.epochs)  # fmt: skip


def build_manifest(
    cfg: RunConfig, prepared: Prepared, plan: dict, *, planned_tasks: int | None, **extra: Any
) -> Manifest:
    """A manifest of `plan` for the prepared target and vocab; `extra`: further Manifest
    fields (a live run's `mode` and `live`)."""
    info = prepared.info
    return Manifest(
        run=cfg.run,
        plan=plan,
        plan_hash=plan_hash(plan),
        planned_tasks=planned_tasks,
        target=ManifestTarget(
            model=cfg.target.model,
            fingerprint=prepared.target_fingerprint,
            tokenizer_fingerprint=prepared.tokenizer_fingerprint,
            num_layers=info.num_layers,
            hidden_size=info.hidden_size,
            vocab_size=info.vocab_size,
        ),
        strategy=cfg.strategy.name,
        vocab=VocabTable(d2t=tuple(prepared.vocab.d2t.tolist()), target_vocab_size=info.vocab_size),
        **extra,
    )


def _task(run: str, sample: TokenizedSample, epoch: int, index: int) -> PromptTask:
    return PromptTask(
        task_id=f"t{index}", run_id=run, epoch=epoch, index=index,
        input_ids=tuple(sample.input_ids.tolist()), loss_mask=tuple(sample.loss_mask.tolist()),
    )  # fmt: skip


async def _resume_point(run: RunBus) -> tuple[int, int] | None:
    """(epoch, task index) of the last dataset task in TASKS, or None if there is none."""
    stored = await last(run.bus, run.names.tasks_stream, run.names.tasks)
    if stored is None:
        return None
    try:
        task = PromptTask.from_bytes(stored.data)
    except RecordError:  # not ours to resume from: publish everything (dedup drops repeats)
        return None
    return (task.epoch, task.index) if task.source == "dataset" else None


async def feed(
    run: RunBus,
    prepared: Prepared,
    manifest: Manifest,
    data: DataConfig,
    *,
    batch: int = 256,
    max_pending: int | None = None,
    on_progress=None,
) -> int:
    """Publish the run's tasks, `data.epochs` seeded permutations of `prepared.samples` (see
    module doc), holding the producers' lag under `max_pending` (default 4 x
    `bus.max_ack_pending`); returns the task count. Idempotent: resumes after the last task
    published, returns at once once the feed is complete. Raises `ConfigError` when the run
    already has a manifest of another plan. `on_progress(published, planned, waiting)` after
    each batch and every ~10 s while held back (`waiting`: the producers' lag then, else None).
    `RecordError(reason="oversize")` before anything is written when the longest task is over
    the broker's `max_payload`.
    """
    kv = run.kv
    done = await kv.feed_complete()
    if done is not None:
        log.info("feed of run %s already complete (%d tasks)", run.run, done)
        return done
    existing = await kv.get_manifest()
    if existing is not None and existing.plan_hash != manifest.plan_hash:
        raise ConfigError(
            f"run {run.run!r} already has a manifest of another plan ({existing.plan_hash} != "
            f"{manifest.plan_hash}): use another run name, or the original data/strategy settings"
        )
    if prepared.samples:  # the longest task must fit the broker before anything is sent
        longest = max(range(len(prepared.samples)), key=prepared.samples.length)
        probe = _task(run.run, prepared.samples[longest], 0, longest)
        check_payload_sizes(
            run.bus, [(run.names.tasks, encode(probe), {"Nats-Msg-Id": probe.msg_id})]
        )
    if existing is None:
        await kv.put_manifest(manifest)
    max_pending = max_pending or 4 * run.bus.cfg.max_ack_pending
    resume = await _resume_point(run)
    total = 0
    planned = data.epochs * len(prepared.samples)
    report = on_progress or (lambda published, planned, waiting: None)
    for epoch in range(data.epochs):
        order = epoch_order(len(prepared.samples), data.seed, epoch)
        start = 0
        if resume is not None:
            r_epoch, r_index = resume
            if epoch < r_epoch:
                total += len(order)
                continue
            if epoch == r_epoch:
                start = order.index(r_index) + 1
                total += start
        for lo in range(start, len(order), batch):
            told = 0.0
            while (lag := (await run.lag(PRODUCERS)).messages) >= max_pending:
                if time.monotonic() - told >= 10:
                    report(total, planned, lag)
                    told = time.monotonic()
                await asyncio.sleep(0.2)
            tasks = [_task(run.run, prepared.samples[i], epoch, i) for i in order[lo : lo + batch]]
            # one trace per published batch: its tasks' headers carry it to their captures
            with span("feed", attributes={"run": run.run, "epoch": epoch, "tasks": len(tasks)}):
                await run.publisher.publish_many(run.names.tasks, tasks)
            total += len(tasks)
            report(total, planned, None)
    await kv.mark_feed_complete(total)
    log.info("fed %d tasks to run %s", total, run.run)
    return total
