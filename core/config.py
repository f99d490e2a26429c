"""The run configuration: one YAML file, validated by pydantic, with dotted overrides.

The config is the composition tree: every section is a strict model (`extra="forbid"`: a typo
fails at load, naming the key and the value) and components take their own section
(`cfg.store.build()`, `build_engine(cfg.target)`, `Trainer(..., cfg.training)`). A name that
chooses a component (`deployment.mode`, `target.engine`, `strategy.name`, the `store.uri`
scheme) must be built (`core.registry`); cross-field rules are validators of `RunConfig`.
`load_config(path, ["training.lr=2e-4"])` is the CLI's entry point.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from specbus.core.audit import AuditConfig  # the capture audit's section (core/audit.py)
from specbus.core.config_methods import (  # noqa: F401  (re-exported: the per-method sections)
    DominoConfig,
    DSparkConfig,
    PEagleSection,
    Section,
)
from specbus.core.config_telemetry import TelemetryConfig
from specbus.core.errors import ConfigError
from specbus.core.registry import ENGINES, MODES, STORES, STRATEGIES

RUN_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class BusConfig(Section):
    """Where the broker is and how the streams/consumers are declared."""

    # None: start the embedded nats-server (specbus up / demo). A cluster: every node's URL,
    # comma-separated (`nats://a:4222,nats://b:4222,nats://c:4222`); clients fail over.
    url: str | None = None
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: Path | None = None
    nkey_file: Path | None = None  # an NKey seed file (`specbus auth`: one per role)
    inbox_prefix: str | None = None  # replies' subject prefix (`specbus auth`: one per role)
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    connect_timeout_s: float = Field(5.0, gt=0)
    max_reconnect_attempts: int = -1  # forever: a restarted broker is a normal event
    reconnect_wait_s: float = Field(0.5, gt=0)
    replicas: int = Field(1, ge=1, le=5)  # 3 on a JetStream cluster
    ack_wait_s: float = Field(60.0, gt=0)
    max_deliver: int = Field(5, ge=1)
    max_ack_pending: int = Field(256, ge=1)
    duplicate_window_s: float = Field(120.0, gt=0)
    # Retention per stream (docs/bus.md, "Retention"): age in seconds (0: no age limit) and
    # bytes (-1: no limit); past either the oldest messages go. TASKS: recapture reads a task
    # back by sequence; SAMPLES: a resume replays from its checkpoint's floor; DEAD: inspection.
    tasks_max_age_s: float = Field(0.0, ge=0)
    tasks_max_bytes: int = Field(-1, ge=-1)
    samples_max_age_s: float = Field(7 * 24 * 3600.0, ge=0)  # 0: kept (recordings)
    samples_max_bytes: int = Field(-1, ge=-1)
    dead_max_age_s: float = Field(0.0, ge=0)
    dead_max_bytes: int = Field(-1, ge=-1)
    nak_delay_s: float = Field(1.0, ge=0)
    heartbeat_s: float = Field(10.0, gt=0)
    fetch_timeout_s: float = Field(1.0, gt=0)
    publish_window: int = Field(1024, ge=1)  # async publishes awaiting their PubAck at once
    # An outage is ridden through; this long after it began, BrokerUnavailable (bus/outage.py)
    outage_give_up_s: float = Field(900.0, gt=0)
    # A process started while the broker is down waits this long for the first connection
    # (a wrong URL fails after it, said from the first attempt; auth errors fail at once).
    connect_give_up_s: float = Field(120.0, gt=0)


class MooncakeConfig(Section):
    """How a process reaches the Mooncake cluster of a `mooncake://` store, and how releases refused
    under a read lease are retried."""

    master: str = "127.0.0.1:50051"
    metadata: str = "P2P"  # "P2P" handshake, or http://127.0.0.1:port/metadata
    protocol: Literal["tcp", "rdma"] = "tcp"
    device: str = ""
    local_hostname: str = "127.0.0.1"
    segment_bytes: int | None = Field(None, gt=0)  # the node's; None: budget_bytes (store.md)
    buffer_bytes: int = Field(256 << 20, gt=0)  # per-client pool of registered transfer buffers
    # The master's HTTP admin/metrics endpoint (usage, key listing); "" = master host, port 9003.
    admin: str = ""
    client_buffer_bytes: int = Field(16 << 20, gt=0)  # Mooncake's own local buffer per client
    release_retry_s: float = Field(0.5, gt=0)  # first retry of a remove refused under a read lease
    force_release_after_s: float = Field(15.0, gt=0)  # then force it (> the master's 10 s lease)
    http_timeout_s: float = Field(5.0, gt=0)
    usage_refresh_s: float = Field(0.25, ge=0)  # budget checks reuse the master's count this long


class HttpStoreConfig(Section):
    """`http://` (W3'): each producer serves the features it holds; trainers fetch them."""

    local: str = "mem://"  # producer: the store behind its feature server (in its process)
    token: str | None = None  # bearer token of producers and trainers; None: $SPECBUS_STORE_TOKEN
    advertise: str | None = None  # producer: the host its refs name; None: the bind host
    connect_timeout_s: float = Field(2.0, gt=0)
    read_timeout_s: float = Field(30.0, gt=0)
    connections: int = Field(16, ge=1)  # trainer: pooled connections per producer
    sweep_every_s: float = Field(2.0, gt=0)  # producer: release what the trainers acked


class StoreConfig(Section):
    """The feature store: `mem://`, `shm://[dir]`, `mooncake://<store_id>`, `file:///dir` or
    `http://host:port` (a producer's bind address; refs name `http://host:port/<store_id>`);
    a scheme of `core.registry.STORES`."""

    uri: str = "shm://"
    budget_bytes: int = Field(4 << 30, gt=0)
    crc: bool = False
    screen_nonfinite: bool = True
    mooncake: MooncakeConfig = MooncakeConfig()
    store_id: str | None = None  # None: from the URI, else "default"
    gc_grace_s: float = Field(60.0, ge=0)  # gc(live) spares samples younger than this
    pool_bytes: int = Field(256 << 20, ge=0)  # shm: pre-faulted receive pool per process (0: none)
    keep_on_close: bool = False  # shm: keep the store when its last process closes it
    recycle_bytes: int = Field(256 << 20, ge=0)  # shm: released files kept for reuse (0: none)
    http: HttpStoreConfig = HttpStoreConfig()
    # An unavailable store (a restarting node) is waited for this long, the work's lease kept
    # alive; then the producer or trainer rank stops (a full store: waited out, store.md).
    unavailable_give_up_s: float = Field(300.0, gt=0)

    @field_validator("uri")
    @classmethod
    def _built_scheme(cls, uri: str) -> str:
        scheme, sep, _ = uri.partition("://")
        if not sep:
            raise ValueError(f"store.uri {uri!r} must look like scheme://...")
        STORES.check(scheme)
        return uri

    def build(self, **overrides: Any):
        """Open the store this section names (`core.store.open_store`; `overrides` replace
        fields for this handle). Raises `ConfigError`, `StoreUnavailable`."""
        from specbus.core.store import open_store

        return open_store(self, **overrides)


class TargetConfig(Section):
    """The frozen target and the engine that runs it (`producers.engines.build_engine`)."""

    engine: str = "hf"  # a name of core.registry.ENGINES
    model: str = "smollm2-135m-instruct"  # the embedded default, or a local HF directory
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = (
        "auto"  # auto: bf16 on GPU, fp32 on CPU
    )
    device: str = "auto"
    aux_layers: list[int] | None = None  # None: the strategy's default for the target depth
    context_length: int | None = None  # None: the model config's max_position_embeddings
    capture_batch: int = Field(4, ge=1)
    tp_size: int = Field(1, ge=1)
    max_total_tokens: int | None = Field(None, ge=1)  # engine's tokens per forward, if bounded
    # hf engine: each decoder layer torch.compile'd for capture (~1 min on the first lengths)
    compile: bool = False
    # hf engine on CUDA: the prefill replayed as a CUDA graph per (batch, length rounded up to
    # graph_bucket) up to graph_max_tokens a batch (producers/engines/prefill_graphs.py)
    cuda_graphs: bool = False
    graph_bucket: int = Field(256, ge=1)
    graph_max_tokens: int = Field(16384, ge=1)
    quantize: Literal["none", "fp8"] = "none"  # hf: decoder linears in FP8 (core/models/fp8.py)
    cache_dir: Path | None = None  # converted embedded target; None: $SPECBUS_CACHE or ~/.cache
    # engine sglang_server (docs/sglang.md, "Driven capture"): the running server's base URL,
    # how long an unreachable server is retried, how long the intake may take to hear of a capture
    server_url: str | None = None
    server_give_up_s: float = Field(60.0, gt=0)
    capture_wait_s: float = Field(30.0, gt=0)

    @field_validator("engine")
    @classmethod
    def _built_engine(cls, name: str) -> str:
        return ENGINES.check(name)

    @model_validator(mode="after")
    def _compilable(self) -> TargetConfig:
        plain_hf = self.engine == "hf" and self.tp_size == 1
        for flag in ("compile", "cuda_graphs", "quantize"):
            if getattr(self, flag) not in (False, "none") and not plain_hf:
                raise ValueError(f"target.{flag} is the hf engine's with tp_size 1 (got engine "
                                 f"{self.engine!r}, tp_size {self.tp_size}): other engines "
                                 "compile, graph and quantise their own way")  # fmt: skip
        return self


class DraftConfig(Section):
    """The draft's architecture (a name of `core.models.registry`) and its widths; None: the target's."""

    architecture: str = "llama_eagle3"
    num_layers: int = Field(1, ge=1)
    hidden_size: int | None = None  # None: the target's
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    draft_vocab_size: int = Field(32000, ge=1)


class StrategyConfig(Section):
    """The training algorithm (a name of `core.registry.STRATEGIES`) and its draft."""

    name: str = Field("eagle3", pattern=r"^[a-z0-9_]+$")
    ttt_length: int = Field(7, ge=1)
    step_weight: float = Field(0.8, gt=0)
    attention: Literal["auto", "sdpa", "flex", "flash"] = "auto"
    draft: DraftConfig = DraftConfig()
    # DFlash family (dflash, domino, dspark)
    block_size: int = Field(16, ge=2)
    num_anchors: int = Field(512, ge=1)
    loss_gamma: float = Field(7.0, gt=0)
    mask_token_id: int | None = Field(None, ge=0)  # None: the target's pad, else eos token
    anchor_seed: int = 0  # anchors are drawn from a generator seeded by (this, step, rank)
    chunk_blocks: int = Field(128, ge=0)  # blocks per logits chunk (0: all at once)
    # EAGLE3, long context (docs/eagle3.md): a batch longer than chunk_tokens forms its teacher,
    # loss and eager attention that many positions at a time; from checkpoint_tokens tokens per
    # micro-batch (B * L) its TTT steps are recomputed in the backward. None: never.
    chunk_tokens: int | None = Field(4096, ge=1)
    checkpoint_tokens: int | None = Field(65536, ge=1)
    domino: DominoConfig = DominoConfig()
    dspark: DSparkConfig = DSparkConfig()
    peagle: PEagleSection = PEagleSection()

    @field_validator("name")
    @classmethod
    def _built_strategy(cls, name: str) -> str:
        return STRATEGIES.check(name)

    def build(self, target, *, heads=None, aux_layers: list[int] | None = None):
        """The strategy for `target` (a `TargetInfo`; `heads` for `build_model` and losses
        that recompute the teacher; `aux_layers` overrides its default capture layers)."""
        from specbus.core.strategies.base import build_strategy

        return build_strategy(self, target, heads=heads, aux_layers=aux_layers)


class DataConfig(Section):
    """The training data: a source (gsm8k, chatterbot or a JSONL path), how it is tokenised, split, repeated."""

    source: str = "gsm8k"  # gsm8k | chatterbot | a JSONL path
    max_length: int = Field(512, ge=8)
    # a record over the run's maximum (max_length, or the target's context): skip = not fed,
    # named in one warning; truncate = cut to it (SpecForge's preprocessing); refuse = the feed
    # fails before anything is published
    over_length: Literal["skip", "truncate", "refuse"] = "skip"
    last_turn_only: bool = False
    limit: int | None = Field(None, ge=1)
    holdout: int = Field(50, ge=0)
    chat_template: str | None = None  # assistant-span markers (core.data.templates); None: detect
    epochs: int = Field(1, ge=1)
    seed: int = 0


class TrainingConfig(Section):
    """The trainer's section: optimizer, schedule, batch geometry, data parallelism, checkpoints,
    logging (`Trainer` and `build_optimizer`/`build_scheduler` read it)."""

    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)  # torch's AdamW default, as both references
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_ratio: float = Field(0.1, gt=0, le=1)  # wsd: the final fraction of steps that decays to 0
    warmup_ratio: float = Field(0.015, ge=0, le=1)
    grad_clip: float = Field(0.5, gt=0)
    micro_batch: int = Field(1, ge=1)
    accumulation: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    max_minutes: float | None = Field(None, gt=0)  # stop (all ranks together) after this long
    total_steps: int | None = Field(None, ge=1)  # schedule length when the data size is unknown
    seed: int = 0
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # ddp: replicated draft, one gradient all-reduce per optimizer step; fsdp: parameters,
    # gradients and optimizer state sharded over the ranks (FSDP2), one reduce-scatter per step
    wrap: Literal["ddp", "fsdp"] = "ddp"
    prefetch: int = Field(2, ge=0)
    # elastic trainers: how long a new world's ranks wait for each other at init (ops/elastic.py)
    elastic_init_timeout_s: float = Field(120.0, gt=0)
    checkpoint_dir: Path | None = None  # None: <run_dir>/checkpoints
    checkpoint_every: int = Field(100, ge=1)
    keep_checkpoints: int = Field(3, ge=1)
    log_every: int = Field(10, ge=1)
    # torch.profiler around this step (0-based): collectives, op table, trace (run_dir/profile)
    profile_step: int | None = Field(None, ge=0)
    overlap_steps: bool | None = None  # queue a step before the last one is done (None: CUDA)


class DeploymentConfig(Section):
    """How the run's processes are laid out: a mode of `core.registry.MODES`."""

    mode: str = "disaggregated"
    # Colocated mode refuses these (>1) by name: the capture path has no such parallelism.
    sequence_parallel: int = Field(1, ge=1)
    target_dp: int = Field(1, ge=1)
    target_ep: int = Field(1, ge=1)
    # Colocated: windows captured ahead of the one training (0: the next capture starts after
    # the last window is released, residency one window; 1: capture overlaps the step, two
    # windows resident). Target-TP islands need 0.
    colocated_prefetch: int = Field(0, ge=0)

    @field_validator("mode")
    @classmethod
    def _built_mode(cls, name: str) -> str:
        return MODES.check(name)


# ---- live mode (deployment.mode: live): intake, capture sink, serving server --------------
class LiveConfig(Section):
    """Live mode: serving servers capture user requests and push them to the intake.

    The intake (`specbus intake`) serves the capture handshake and turns records into
    SampleRefs; the capture sink in every serving server learns everything else from the
    handshake. Watermarks are fractions of `min(store.budget_bytes, what the store can hold)`."""

    host: str = "127.0.0.1"  # the intake binds here (loopback by default)
    port: int = Field(8470, ge=0, le=65535)  # 0: a free port (in <run_dir>/live/intake.json)
    # where serving servers reach the intake; None: <run_dir>/live/intake.json
    url: str | None = None
    # Bearer token; None: $SPECBUS_INTAKE_TOKEN, else one generated once and kept (0600) in
    # <run_dir>/live/intake.json, which `specbus serve` on the same host reads.
    token: str | None = None
    sample_rate: float = Field(1.0, ge=0, le=1)  # fraction of requests captured
    min_num_tokens: int = Field(2, ge=1)  # generated (supervised) rows a capture needs at least
    # rows per capture at most (longer ones keep their first rows); None: data.max_length
    max_num_tokens: int | None = Field(None, ge=2)
    shed_watermark: float = Field(0.9, gt=0, le=1)  # 429 above this fraction (lag bytes, residency)
    max_lag_refs: int | None = Field(None, ge=1)  # 429 when the trainers lag by this many refs
    max_inflight: int = Field(64, ge=1)  # records being validated/published at once; 429 beyond
    publish_timeout_s: float = Field(2.0, gt=0)  # intake: a publish the broker does not ack -> 503
    record_timeout_s: float = Field(10.0, gt=0)  # sink: POST timeout (> publish_timeout_s)
    max_record_bytes: int = Field(256 << 10, ge=1024)  # a POSTed record body at most
    queue: int = Field(32, ge=1)  # sink: captures waiting for the writer thread; full: dropped
    vocab_source: str | None = None  # the draft vocab's prior (a data source); None: data.source
    serve_host: str = "127.0.0.1"  # `specbus serve`
    serve_port: int = Field(8000, ge=0, le=65535)
    max_new_tokens: int = Field(256, ge=1)  # `specbus serve`: a request's max_tokens cap
    serve_batch: int = Field(4, ge=1)  # `specbus serve`: requests decoded together (a wave)
    # HTTPS for the intake (both or neither; plain HTTP is then refused); tls_ca: what the
    # sink of `specbus serve` trusts (None: the system's CAs). docs/live.md, "Security".
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None

    @model_validator(mode="after")
    def _consistent(self) -> LiveConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("live.tls_cert and live.tls_key go together (the intake's HTTPS)")
        if self.record_timeout_s <= self.publish_timeout_s:
            raise ValueError(
                f"live.record_timeout_s ({self.record_timeout_s}) must exceed "
                f"live.publish_timeout_s ({self.publish_timeout_s}): a sink must not give "
                "up (and remove the keys) on a record the intake may still publish"
            )
        return self


class RunConfig(Section):
    """The run's composition tree: one section per component, plus the run's name and directory;
    cross-field rules are its validators."""

    run: str = "default"
    run_dir: Path | None = None  # None: ./runs/<run>
    bus: BusConfig = BusConfig()
    store: StoreConfig = StoreConfig()
    target: TargetConfig = TargetConfig()
    strategy: StrategyConfig = StrategyConfig()
    data: DataConfig = DataConfig()
    training: TrainingConfig = TrainingConfig()
    deployment: DeploymentConfig = DeploymentConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    live: LiveConfig = LiveConfig()
    audit: AuditConfig = AuditConfig()

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if not RUN_NAME.match(self.run):
            raise ValueError(
                f"run name {self.run!r} must match {RUN_NAME.pattern} (it becomes a subject token)"
            )
        return self

    @model_validator(mode="after")
    def _colocated(self) -> RunConfig:
        """What colocated mode cannot run, known from the config alone (the refusals that need
        the target or the world size are the mode's: ops/modes.py)."""
        if self.deployment.mode != "colocated":
            return self
        for key in ("sequence_parallel", "target_dp", "target_ep"):
            value = getattr(self.deployment, key)
            if value > 1:
                raise ValueError(
                    f"deployment.{key}={value} is not supported in colocated mode (use 1)"
                )
        tp = self.target.tp_size
        if tp > 1 and self.target.engine != "hf":
            raise ValueError(
                f"target.tp_size={tp} in colocated mode runs on the hf engine, "
                f"not target.engine={self.target.engine!r}"
            )
        if tp > 1 and self.deployment.colocated_prefetch:
            raise ValueError(
                f"deployment.colocated_prefetch={self.deployment.colocated_prefetch} needs "
                f"target.tp_size=1 (an island captures in step with its peers): use 0"
            )
        return self

    @property
    def resolved_run_dir(self) -> Path:
        """`run_dir`, else `./runs/<run>`."""
        return self.run_dir if self.run_dir is not None else Path("runs") / self.run

    @property
    def resolved_tensorboard_dir(self) -> Path:
        """`telemetry.tensorboard_dir`, else `<run_dir>/tb`."""
        return self.telemetry.tensorboard_dir or (self.resolved_run_dir / "tb")


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`"training.lr=2e-4"` -> `("training.lr", 0.0002)`; the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if (
        not sep
        or not key
        or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", key)
    ):
        raise ConfigError(f"override {text!r} must look like section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {e}") from e
    return key, value


def build_config(
    tree: dict[str, Any] | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Validate a config tree plus dotted overrides. Raises `ConfigError` naming key and value."""
    tree = dict(tree or {})
    for text in overrides:
        _set_dotted(tree, *parse_override(text))
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "<config>"
            value = err.get("input")
            shown = (
                "" if err["type"] == "missing" or isinstance(value, dict) else f" (got {value!r})"
            )
            msg = err["msg"].removeprefix("Value error, ")  # our validators' words, as written
            lines.append(f"{loc}: {msg}{shown}")
        raise ConfigError("invalid run config:\n  " + "\n  ".join(lines)) from e


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Load a YAML run config (or the defaults when `path` is None) and apply overrides."""
    return build_config(read_config_tree(path), overrides)


def read_config_tree(path: str | Path | None) -> dict[str, Any]:
    """The mapping a YAML run config holds ({} for None or an empty file); `ConfigError` for a
    missing, unreadable or malformed file."""
    if path is None:
        return {}
    path = Path(path)
    try:
        loaded = yaml.safe_load(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"config file {str(path)!r} does not exist") from e
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping, got {type(loaded).__name__}"
        )
    return loaded or {}


def dump_config(cfg: RunConfig) -> str:
    """The config as YAML that `load_config` reads back to an equal config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
