"""Side-by-side check of specbus's P-EAGLE against speculators 0.9.0's `PEagleDraftModel`.

Not a test (speculators is no dependency): a developer tool, run in the reference virtualenv
of `ops/bench/dflash_parity.py` with speculators added without its dependencies (they pull an
unpinned torch, torchvision and torchaudio), then the pure-Python modules `import speculators`
needs:

    /work/venv-specforge/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 \
        openai httpx2 sniffio datasets multiprocess pandas python-dateutil pyarrow dill xxhash \
        fsspec filelock loguru pydantic-settings python-dotenv
    PYTHONPATH=$PWD/.dev:$PWD /work/venv-specforge/bin/python ops/bench/peagle_parity.py

(`.dev/specbus` links this checkout's folders, as docs say for running the worktree.) For
each variant it builds speculators' draft (a tiny random `transformer_layer_config`, eager
attention, a draft vocabulary of 64 of 96 tokens through t2d/d2t, the frozen lm_head and the
teacher head set to the target lm_head's draft rows) and ours with the same weights, collates
three samples of lengths 24/17/9 with random loss masks with specbus's `PEagleStrategy.collate`
(speculators' `shift_batch` + packing), draws the COD rows once with `sample_cod` and patches
them into the reference's sampler, and compares the loss, per-depth accuracy counts, every
parameter gradient and three AdamW steps (fresh batch and rows each step; losses and final
weights) in fp32 at rtol 1e-4 / atol 1e-5, printing the worst relative error per quantity.
The reference's teacher norm (`verifier_norm`) is replaced by the identity: specbus captures
the target's post-norm final hidden state, speculators the pre-norm one and norms it itself.

Variants: `qwen3` (the reference's defaults: qwen3 layer, norm_before_residual, a 2048
sliding window), `qwen3-window` (window 6: the window cuts the context), `llama-2layers`
(llama layers, residual not normed, two layers: the plain second layer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

V, VD, H, L_TARGET, DEPTHS, MASK = 96, 64, 32, 6, 4, 1
AUX = [1, 2, 3]
RTOL, ATOL = 1e-4, 1e-5
VARIANTS = {  # name -> (layer_type, num_layers, norm_before_residual, sliding_window)
    "qwen3": ("qwen3", 1, True, 2048),
    "qwen3-window": ("qwen3", 1, True, 6),
    "llama-2layers": ("llama", 2, False, None),
}


def rel_err(a, b) -> float:
    import torch

    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    keep = b.abs() >= 1e-6
    if not keep.any():
        return float((a - b).abs().max()) if a.numel() else 0.0
    return float(((a - b).abs()[keep] / b.abs()[keep]).max())


class Report:
    def __init__(self, name: str):
        self.name, self.worst, self.failures = name, {}, []

    def check(self, quantity: str, ours, ref) -> None:
        import torch

        ours, ref = torch.as_tensor(ours).double(), torch.as_tensor(ref).double()
        self.worst[quantity] = max(self.worst.get(quantity, 0.0), rel_err(ours, ref))
        try:
            torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL)
        except AssertionError as e:
            self.failures.append(f"{quantity}: {str(e).splitlines()[0]}")


def target_info():
    from pathlib import Path

    from specbus.core.models.target import TargetInfo

    return TargetInfo(
        name="tiny", path=Path("."), model_type="llama", num_layers=L_TARGET, hidden_size=H,
        vocab_size=V, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=256,
        rope_theta=10000.0, pad_token_id=MASK,
    )  # fmt: skip


def reference_model(layer_type: str, layers: int, nbr: bool, window: int | None):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig, Qwen3Config

    cls = Qwen3Config if layer_type == "qwen3" else LlamaConfig
    kinds = ["sliding_attention" if window else "full_attention"] * layers
    tl = cls(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, tie_word_embeddings=False,
        sliding_window=window or 4096, layer_types=kinds, hidden_act="silu",
        use_sliding_window=bool(window),  # as speculators' create_transformer_layer_config
    )  # fmt: skip
    tl._attn_implementation = "eager"
    cfg = PEagleSpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=VD, norm_before_residual=nbr,
        eagle_aux_hidden_state_layer_ids=[a + 1 for a in AUX], mask_token_id=MASK,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=DEPTHS)],
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )  # fmt: skip
    return PEagleDraftModel(cfg).float()


def samples(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (24, 17, 9):
        m = (torch.rand(n, generator=g) < 0.8).long()
        m[: n // 4] = 0
        out.append({
            "input_ids": torch.randint(2, V, (n,), generator=g), "loss_mask": m,
            "hidden_states": torch.randn(n, len(AUX) * H, generator=g),
            "target": torch.randn(n, H, generator=g),
        })  # fmt: skip
    return out


def run(name: str, steps: int = 3) -> Report:
    import speculators.models.peagle.core as ref_core
    import torch
    from specbus.core.config import build_config
    from specbus.core.data.vocab import VocabMapping
    from specbus.core.models.target import TargetHeads
    from specbus.core.strategies.base import build_strategy
    from specbus.core.strategies.peagle import sample_cod
    from speculators.losses import resolve_loss_config

    layer_type, layers, nbr, window = VARIANTS[name]
    report = Report(name)
    torch.manual_seed(0)
    info = target_info()
    embed, head = torch.randn(V, H), torch.randn(V, H) * 0.3
    keep = torch.randperm(V, generator=torch.Generator().manual_seed(5))[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    vocab = VocabMapping(d2t=keep - torch.arange(VD), t2d=t2d)
    cfg = build_config({"strategy": {
        "name": "peagle", "mask_token_id": MASK,
        "draft": {"num_layers": layers, "draft_vocab_size": VD},
        "peagle": {"num_depths": DEPTHS, "layer_type": layer_type, "norm_before_residual": nbr,
                   "sliding_window": window, "max_anchors": 12},
    }})  # fmt: skip
    strategy = build_strategy(cfg.strategy, info, heads=TargetHeads(embed, head), aux_layers=AUX)
    ours = strategy.build_model(info, strategy.heads, vocab)
    ref = reference_model(layer_type, layers, nbr, window)
    with torch.no_grad():
        ref.embed_tokens.weight.copy_(embed)
        ref.lm_head.weight.copy_(head[t2d])
        ref.verifier_lm_head.weight.copy_(head[t2d])
        ref.t2d.copy_(t2d)
        ref.d2t.copy_(vocab.d2t)
    ref.verifier_norm = torch.nn.Identity()  # we feed the post-norm final hidden state
    ref_state = {
        k: v for k, v in ref.state_dict().items() if not k.startswith(("verifier_", "rotary"))
    }
    missing, unexpected = ours.load_state_dict(ref_state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"{name}: weight names differ: missing {missing}, unexpected {unexpected}")
    loss_config = resolve_loss_config("kl_div", "eager")
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    our_opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-2)
    if {n for n, p in ref.named_parameters() if p.requires_grad} != {
        n for n, p in ours.named_parameters() if p.requires_grad
    }:
        raise SystemExit(f"{name}: the trained parameters differ")
    gen = torch.Generator().manual_seed(1234)
    for step in range(steps):
        batch = strategy.collate(samples(step))
        t = batch.tensors
        cod = sample_cod(t["loss_mask"][0], DEPTHS, 0.7, 0.2, 12, gen)
        ref_core.generate_cod_sample_indices = lambda *a, c=cod, **k: c
        _, ref_loss, ref_m = ref(
            hidden_states=t["hidden_states"], input_ids=t["input_ids"],
            document_ids=t["document_ids"], loss_mask=t["loss_mask"],
            verifier_last_hidden_states=t["target"], loss_config=loss_config,
            num_depths=DEPTHS, max_anchors=12,
        )  # fmt: skip
        t["cod_anchor"], t["cod_depth"] = cod
        loss, m = strategy.forward_loss(ours, batch)
        report.check("loss", loss.detach(), ref_loss.detach())
        report.check("accuracy", sum(m[f"correct_{d}"] for d in range(DEPTHS)),
                     ref_m["full_acc_sum"])  # fmt: skip
        for d in range(DEPTHS):
            report.check("per-depth correct / total", torch.stack([m[f"correct_{d}"], m[f"denom_{d}"]]),
                         torch.stack([ref_m[f"position_{d}_acc_sum"], ref_m[f"position_{d}_acc_total"]]))  # fmt: skip
        ref_opt.zero_grad()
        our_opt.zero_grad()
        ref_loss.backward()
        loss.backward()
        ref_params = dict(ref.named_parameters())
        for pname, p in ours.named_parameters():
            if p.requires_grad:
                report.check("gradients", p.grad, ref_params[pname].grad)
        ref_opt.step()
        our_opt.step()
    ref_params = dict(ref.named_parameters())
    for pname, p in ours.named_parameters():
        report.check(f"weights after {steps} AdamW steps", p.detach(), ref_params[pname].detach())
    export_check(report, strategy, ours, embed, head, gen)
    return report


def export_check(report: Report, strategy, ours, embed, head, gen) -> None:
    """Export the trained draft (fp32), load it with speculators' own `from_pretrained` (the
    class from `speculators_model_type`, the verifier's heads from a verifier directory) and
    compare its loss with ours on a fresh batch and the same rows."""
    import tempfile
    from pathlib import Path

    import speculators.models.peagle.core as ref_core
    import torch
    from safetensors.torch import save_file
    from specbus.core.strategies.peagle import sample_cod
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from speculators.losses import resolve_loss_config
    from transformers import LlamaConfig

    with tempfile.TemporaryDirectory() as tmp:
        verifier = Path(tmp) / "verifier"
        verifier.mkdir()
        LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L_TARGET,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    architectures=["LlamaForCausalLM"]).save_pretrained(verifier)  # fmt: skip
        save_file({"model.embed_tokens.weight": embed, "lm_head.weight": head,
                   "model.norm.weight": torch.ones(H)}, str(verifier / "model.safetensors"))  # fmt: skip
        out = strategy.export(ours, Path(tmp) / "export", dtype="float32", verifier=verifier)
        config = SpeculatorModelConfig.from_pretrained(str(out))
        config.transformer_layer_config._attn_implementation = "eager"
        loaded = SpeculatorModel.from_pretrained(str(out), config=config).float()
        report.check("export: loaded class is PEagleDraftModel",
                     float(type(loaded).__name__ == "PEagleDraftModel"), 1.0)  # fmt: skip
        loaded.verifier_norm = torch.nn.Identity()
        batch = strategy.collate(samples(99))
        t = batch.tensors
        cod = sample_cod(t["loss_mask"][0], DEPTHS, 0.7, 0.2, 12, gen)
        ref_core.generate_cod_sample_indices = lambda *a, c=cod, **k: c
        with torch.no_grad():
            _, ref_loss, _ = loaded(
                hidden_states=t["hidden_states"], input_ids=t["input_ids"],
                document_ids=t["document_ids"], loss_mask=t["loss_mask"],
                verifier_last_hidden_states=t["target"], num_depths=DEPTHS,
                loss_config=resolve_loss_config("kl_div", "eager"),
            )  # fmt: skip
            t["cod_anchor"], t["cod_depth"] = cod
            loss, _ = strategy.forward_loss(ours, batch)
        report.check("export: loss of the loaded draft", loss, ref_loss)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the worst errors here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    out, ok = {}, True
    for name in args.variants.split(","):
        r = run(name, args.steps)
        out[name] = {"worst_relative_error": r.worst, "failures": r.failures}
        print(
            f"== peagle {name}: {'PASS' if not r.failures else 'FAIL'} (rtol {RTOL}, atol {ATOL})"
        )
        for q, e in r.worst.items():
            print(f"   {q:38s} worst relative error {e:.2e}")
        for f in r.failures:
            print(f"   FAIL {f}")
        ok &= not r.failures
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
