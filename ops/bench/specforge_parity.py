"""Side-by-side check of specbus's EAGLE3 objective against SpecForge 0.2.0 on CPU.

Not a test (SpecForge is no dependency): a developer tool. Fetch the reference wheel with
the ordinary client and unpack it, then run this script:

    pip download specforge==0.2.0 --no-deps -d /tmp/sf && unzip -q -o /tmp/sf/specforge-0.2.0-*.whl -d /tmp/sf/x
    python ops/bench/specforge_parity.py --specforge /tmp/sf/x --dtype bf16

It builds a tiny random Llama target, captures features with the hf engine, trains the draft
a few steps (so accuracies are non-zero), loads the same weights into SpecForge's
`LlamaForCausalLMEagle3` + `OnlineEagle3Model` + `Eagle3TrainStrategy` (sdpa backend,
`target_repr="hidden_state"` with its `TargetHead`), feeds both the same collated batch and
compares the total loss, per-step ploss/acc/acceptance_rate and every parameter gradient.
SpecForge's Triton loss kernel cannot run on CPU; it is replaced by the reference formula the
SpecForge file itself documents (`_compute_loss`), and `torch.compile` is disabled.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import sys
import tempfile
import types
from pathlib import Path


def import_specforge(root: str):
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    sys.path.insert(0, root)
    import torch
    from torch import nn

    def anything(attr):  # a stub module: any public name is a no-op callable/decorator
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *a, **k: a[0] if len(a) == 1 and callable(a[0]) else None

    for name in ("datasets", "flash_attn", "yunchang", "yunchang.comm", "wandb"):
        try:
            __import__(name)
        except ImportError:
            stub = types.ModuleType(name)
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
            stub.__path__ = []
            stub.__getattr__ = anything
            sys.modules[name] = stub

    class LogSoftmaxLoss:  # the Triton kernel's documented reference
        @staticmethod
        def apply(logits, target_p, position_mask):
            logp = nn.LogSoftmax(dim=2)(logits.float())
            return -torch.sum(position_mask * (target_p * logp), 2).mean()

    loss_module = types.ModuleType("specforge.core.loss")
    loss_module.LogSoftmaxLoss = LogSoftmaxLoss
    sys.modules["specforge.core.loss"] = loss_module


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--specforge", required=True, help="directory holding the unpacked specforge package"
    )
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--ttt", type=int, default=7)
    args = ap.parse_args()
    import_specforge(args.specforge)

    import torch
    from specbus.core.config import DraftConfig, StrategyConfig, TargetConfig
    from specbus.core.data.vocab import build_vocab_mapping, count_tokens
    from specbus.core.models.target import load_target_heads
    from specbus.core.strategies import StepContext, build_strategy
    from specbus.producers.engines.hf import HFEngine
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.contracts import TrainBatch as RefBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    path = Path(tempfile.mkdtemp())
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_theta=5000.0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    engine = HFEngine(TargetConfig(model=str(path)))
    heads = load_target_heads(path)
    strategy = build_strategy(
        StrategyConfig(ttt_length=args.ttt, draft=DraftConfig(draft_vocab_size=200)),
        engine.info,
        heads=heads,
    )
    lengths = (40, 23, 31)
    samples = engine.capture(
        [torch.randint(0, 300, (n,)) for n in lengths],
        [(torch.rand(n) > 0.3).long() for n in lengths],
        strategy.feature_contract(),
    )
    vocab = build_vocab_mapping(
        count_tokens((s["input_ids"], s["loss_mask"]) for s in samples), 200, 300
    )
    draft = strategy.build_model(engine.info, heads, vocab)
    batch = strategy.collate(samples)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(60):  # move off the init so accuracies are not all zero
        loss, _ = strategy.forward_loss(draft, batch, StepContext())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    draft.zero_grad()
    draft = draft.to(dtype)
    for name in ("hidden_states", "target"):
        batch.tensors[name] = batch.tensors[name].to(dtype)
    loss, metrics = strategy.forward_loss(draft, batch, StepContext())
    loss.backward()

    ref_cfg = LlamaConfig(
        **{
            **cfg.to_dict(),
            "num_hidden_layers": 1,
            "draft_vocab_size": 200,
            "architectures": ["LlamaForCausalLMEagle3"],
        }
    )
    reference = LlamaForCausalLMEagle3(ref_cfg, attention_backend="sdpa")
    reference.load_state_dict(draft.state_dict(), strict=True)
    reference = reference.to(dtype)
    reference.freeze_embedding()
    head = TargetHead(str(path))
    head.fc.weight.data.copy_(heads.lm_head)
    head.freeze_weights()
    t = batch.tensors
    ref_batch = RefBatch(
        tensors={
            "input_ids": t["input_ids"],
            "attention_mask": t["attention_mask"],
            "loss_mask": t["loss_mask"],
            "hidden_state": t["hidden_states"],
            "target": t["target"],
        },
        metadata={"target_repr": "hidden_state"},
        sample_ids=["a", "b", "c"],
        strategy="eagle3",
    )
    ref_strategy = Eagle3TrainStrategy(
        OnlineEagle3Model(reference, length=args.ttt, attention_backend="sdpa"),
        target_head=head.to(dtype),
    )
    out = ref_strategy.forward_loss(ref_batch)
    out.loss.backward()

    print(f"loss specbus {loss.item():.9g} specforge {out.loss.item():.9g}")
    worst = 0.0
    for k in range(args.ttt):
        row = [
            (float(metrics[f"{ours}_{k}"]), float(out.metrics[theirs][k]))
            for ours, theirs in (
                ("ploss", "plosses"),
                ("acc", "acces"),
                ("acceptance_rate", "acceptance_rates"),
            )
        ]
        worst = max(worst, *(abs(a - b) for a, b in row))
        print(f"step {k}: " + "  ".join(f"{a:.7f}/{b:.7f}" for a, b in row))
    ref_params = dict(reference.named_parameters())
    for name, param in draft.named_parameters():
        if param.grad is not None:
            diff = (param.grad.float() - ref_params[name].grad.float()).abs().max().item()
            worst = max(worst, diff)
    print(f"largest difference (metrics and gradients): {worst:.3g}")
    sys.exit(0 if worst == 0.0 and loss.item() == out.loss.item() else 1)


if __name__ == "__main__":
    main()
