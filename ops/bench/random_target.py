"""A random target of a real architecture for the GPU benchmarks, and the worker that uses it.

The target is Qwen3-8B's architecture with random weights (nothing is downloaded): its
directory holds `config.json`, a safetensors file with only `embed_tokens` and `lm_head`
(what a trainer reads) and a fingerprint marker. Every engine process builds the full model
from that config with a fixed seed (same compute and feature sizes as the real model; 16 GB
are never written to disk). `python -m specbus.ops.bench.random_target --stats FILE <specbus
args>` runs `specbus ...` with the `hf` engine swapped for this one (`register_engine(...,
replace=True)`), then writes the process's peak CUDA memory to FILE.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
SEED = 0
# --tiny: a 4-layer, 2k-vocab target of the same architecture (a CPU check of the code paths)
TINY = {"vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
_MARKER = "specbus_target.json"  # core.models.target reads the fingerprint from it


# ---------------------------------------------------------------------------------------------
# The random target


def write_target(path: Path, overrides: dict | None = None, device: str = "cuda") -> Path:
    """config.json + heads-only safetensors + fingerprint marker (weights = config + seed)."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    path.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(**{**QWEN3_8B, **(overrides or {})})
    config.save_pretrained(path)
    v, h = config.vocab_size, config.hidden_size
    g = torch.Generator(device=device).manual_seed(SEED)
    heads = {
        name: (torch.randn(v, h, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()
        for name in ("model.embed_tokens.weight", "lm_head.weight")
    }
    save_file(heads, str(path / "model.safetensors"))
    digest = hashlib.sha256((path / "config.json").read_bytes() + f"seed={SEED}".encode())
    (path / _MARKER).write_text(
        json.dumps({"source": "random-qwen3", "fingerprint": digest.hexdigest()[:32]})
    )
    return path


def target_variants(variants) -> dict:
    """The `target` keys a bench run's variants set (`compile`, `graphs`, `fp8`: gpu_pipeline's
    `+...` and gpu_dflash's `@...`)."""
    return {"compile": "compile" in variants, "cuda_graphs": "graphs" in variants,
            "quantize": "fp8" if "fp8" in variants else "none"}  # fmt: skip


def build_random_target(path: Path, device: torch.device | str) -> torch.nn.Module:
    """The full causal LM of `path`'s config, random (seeded) on `device` in bf16, with the
    directory's embed_tokens / lm_head loaded: frozen, eval mode."""
    from specbus.core.models.target import load_target_heads
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    heads = load_target_heads(path, dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(heads.embed_tokens)
        model.get_output_embeddings().weight.copy_(heads.lm_head)
    model.requires_grad_(False)
    return model.eval()


def random_engine(cfg, **kwargs):
    """`hf` engine factory over `build_random_target` (registered in the worker processes)."""
    from specbus.core.models.target import resolve_target_dir
    from specbus.producers.engines.hf import HFEngine, resolve_device

    device = resolve_device(cfg.device)
    model = build_random_target(resolve_target_dir(cfg.model), device)
    return HFEngine(cfg, model=model, **kwargs)


def worker(argv: list[str]) -> int:
    """`--stats FILE <specbus args>`: run `specbus ...` with the random-target engine, then
    write this process's peak CUDA memory to FILE."""
    from specbus.ops.cli import main as cli_main
    from specbus.producers.engines.registry import register_engine

    stats = Path(argv[argv.index("--stats") + 1])
    rest = [a for i, a in enumerate(argv) if a != "--stats" and argv[i - 1] != "--stats"]
    register_engine("hf", random_engine, replace=True)
    code = cli_main(rest)
    if torch.cuda.is_available():
        stats.write_text(
            json.dumps(
                {
                    "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                }
            )
        )
    return code


# ---------------------------------------------------------------------------------------------
# Data


def write_data(path: Path, n: int, seq: int, vocab: int) -> Path:
    """`n` pre-tokenised samples of exactly `seq` tokens; the last three quarters supervised."""
    g = torch.Generator().manual_seed(1)
    with open(path, "w") as f:
        for _ in range(n):
            ids = torch.randint(3, vocab, (seq,), generator=g).tolist()
            mask = [0] * (seq // 4) + [1] * (seq - seq // 4)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return path


def shm_uri(run: str, work: Path, need_bytes: int) -> str:
    """shm:// in /dev/shm when it has room, else a directory under the work dir (page cache)."""
    if Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free > 2 * need_bytes:
        return f"shm://{run}"
    return f"shm://{work / ('shm-' + run)}?store_id={run}"


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
