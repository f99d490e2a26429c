"""The run manifest of a live run, and the capture handshake derived from it.

A live run has no feeder, so the intake writes the manifest when it starts (trainers wait for
it as they wait for a feeder's). What the trainers need from it is what a feeder writes
(plan and hash, target and tokenizer fingerprints, the draft vocab mapping `d2t`), plus a
`live` entry: the capture handshake the intake serves.

The draft vocabulary (EAGLE3's `d2t`/`t2d`) must be fixed before the first sample is trained,
when no traffic has been seen yet. It is built the way the feeder builds it, from the
supervised tokens of a data source that stands for the expected traffic:
`live.vocab_source` (default `data.source`, GSM8K for the embedded default). It is part of
the plan: a restart of the intake with the same settings finds the same manifest; another
vocab source (or strategy, or target) under the same run name is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specbus.core.config import RunConfig
from specbus.core.contracts import Manifest
from specbus.core.errors import ConfigError
from specbus.core.strategies.base import FeatureContract
from specbus.producers.live.wire import CAPTURE_SCHEMA_VERSION, CaptureConfig, FeatureDecl

if TYPE_CHECKING:
    from specbus.bus.topology import RunKV

_INT_DTYPES = {"int64": "int64", "int64|bool": "int64", "bool": "bool"}


def feature_decls(contract: FeatureContract, float_dtype: str) -> tuple[FeatureDecl, ...]:
    """The contract's fields as the sink sees them (sources, concrete dtypes). Raises
    `ConfigError` for a feature a live capture cannot provide."""
    decls = []
    for f in contract.fields:
        if f.name in ("input_ids", "loss_mask"):
            source = f.name
        elif f.name == contract.aux_feature:
            source = "aux"
        elif contract.final_feature is not None and f.name == contract.final_feature:
            source = "final"
        else:
            raise ConfigError(
                f"strategy {contract.strategy!r} needs feature {f.name!r}, which a live capture "
                "(input ids, loss mask, aux layers, final hidden state) cannot provide"
            )
        dtype = float_dtype if f.dtype == "float" else _INT_DTYPES[f.dtype]
        decls.append(FeatureDecl(name=f.name, shape=f.shape, dtype=dtype, source=source))
    return tuple(decls)


def live_plan(cfg: RunConfig, prepared) -> dict[str, Any]:
    """What every process of a live run must agree on (the manifest's identity)."""
    return {
        "mode": "live",
        "strategy": cfg.strategy.model_dump(mode="json"),
        "target": {"model": cfg.target.model, "fingerprint": prepared.target_fingerprint},
        "vocab_source": cfg.live.vocab_source or cfg.data.source,
        "vocab": prepared.vocab.fingerprint(),
    }


def live_manifest(cfg: RunConfig, prepared, capture: CaptureConfig) -> Manifest:
    """The live run's `Manifest`: the feeder's fields (target, vocab table) with
    `mode="live"`, no task count (the schedule is `training.total_steps`/`max_steps`) and the
    capture handshake as its `live` entry."""
    from specbus.producers.feeder import build_manifest

    return build_manifest(cfg, prepared, live_plan(cfg, prepared), planned_tasks=None,
                          mode="live", live=capture.model_dump(mode="json"))  # fmt: skip


def capture_config(
    cfg: RunConfig,
    contract: FeatureContract,
    *,
    store_uri: str,
    store_id: str,
    float_dtype: str,
    target_fingerprint: str,
    tokenizer_fingerprint: str,
) -> CaptureConfig:
    """The handshake the intake serves for `contract` (the strategy's features) and the run's
    store. Raises `ConfigError` when `live.min_num_tokens` leaves no room in a capture."""
    max_tokens = cfg.live.max_num_tokens or cfg.data.max_length
    if cfg.live.min_num_tokens >= max_tokens:
        raise ConfigError(
            f"live.min_num_tokens ({cfg.live.min_num_tokens}) must be below the rows a capture "
            f"holds ({max_tokens}: live.max_num_tokens or data.max_length)"
        )
    return CaptureConfig(
        schema_version=CAPTURE_SCHEMA_VERSION,
        run_id=cfg.run,
        store_uri=store_uri,
        store_id=store_id,
        store_budget_bytes=cfg.store.budget_bytes,
        strategy=contract.strategy,
        features=feature_decls(contract, float_dtype),
        aux_layers=tuple(contract.aux_layers),
        hidden_size=contract.hidden_size,
        dtype=float_dtype,
        min_num_tokens=cfg.live.min_num_tokens,
        max_num_tokens=max_tokens,
        sample_rate=cfg.live.sample_rate,
        target_fingerprint=target_fingerprint,
        tokenizer_fingerprint=tokenizer_fingerprint,
        record_timeout_s=cfg.live.record_timeout_s,
        max_record_bytes=cfg.live.max_record_bytes,
    )


async def ensure_manifest(kv: RunKV, manifest: Manifest) -> Manifest:
    """Write the live manifest, or refresh its `live` entry when one of the same plan exists
    (a restarted intake: sample rate or limits may have changed). Raises `ConfigError` for a
    manifest of another plan under the run's name."""
    existing = await kv.get_manifest()
    if existing is not None:
        if existing.plan_hash != manifest.plan_hash:
            raise ConfigError(
                f"run {manifest.run!r} already has a manifest of another plan "
                f"({existing.plan_hash} != {manifest.plan_hash}; mode {existing.mode}): use "
                "another run name, or the original strategy/target/vocab source"
            )
        if existing == manifest:
            return existing
    await kv.put_manifest(manifest)
    return manifest
