"""Side-by-side check of specbus's DFlash, Domino and DSpark objectives against SpecForge 0.2.0.

Not a test (SpecForge is no dependency): a developer tool, run in a separate virtualenv that
holds the reference and this repo's light dependencies:

    python3 -m venv /work/venv-specforge
    /work/venv-specforge/bin/pip install torch==2.13.0          # the CPU wheel first
    /work/venv-specforge/bin/pip install transformers==5.8.1 pydantic pyyaml safetensors orjson
    /work/venv-specforge/bin/pip install --no-deps specforge==0.2.0
    PYTHONPATH=$PWD /work/venv-specforge/bin/python ops/bench/dflash_parity.py

For each strategy it builds SpecForge's draft (`DFlashDraftModel` / `DominoDraftModel` /
`DSparkDraftModel`, Qwen3 config, eager attention) and training wrapper (`OnlineDFlashModel` /
`OnlineDominoModel` / `OnlineDSparkModel`) with a random frozen embedding and lm_head, copies
the same weights into specbus's `DFlashDraft`, and feeds both the same batch: three samples of
different lengths (right-padded), random loss masks, a draft with grouped-query attention
(4 heads, 2 KV heads), two draft layers, and the same anchors (drawn once with
`sample_anchors` and patched into the reference's sampler). It compares the loss, the metrics
the reference reports (per position for DSpark), every parameter gradient, and then three
AdamW steps (fresh fixed anchors each step; losses and final weights) in fp32 at rtol 1e-4 /
atol 1e-5, and prints the worst relative error per quantity. Domino runs in both label
layouts: `domino` (SpecForge's recipe: `shift_label` true, `pure_draft_prefix_len` 1),
`domino-unshifted` (`shift_label` false, prefix 1) and `domino-p0` (false, 0: specbus's
layout before the settings existed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

V, H, L_TARGET, BLOCK, ANCHORS, MASK = 96, 32, 4, 4, 6, 1
# Domino variants: name -> (shift_label, pure_draft_prefix_len)
DOMINO = {"domino": (True, 1), "domino-unshifted": (False, 1), "domino-p0": (False, 0)}
LAYERS = [1, 2]
RTOL, ATOL = 1e-4, 1e-5


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
        err = rel_err(ours, ref)
        self.worst[quantity] = max(self.worst.get(quantity, 0.0), err)
        try:
            torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL)
        except AssertionError as e:
            self.failures.append(f"{quantity}: {str(e).splitlines()[0]}")


def projector_of(name: str) -> str:
    return "domino" if name in DOMINO else name


def reference_config(name: str):
    from transformers import Qwen3Config

    projector = projector_of(name)
    cfg = Qwen3Config(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, tie_word_embeddings=False,
    )  # fmt: skip
    cfg.layer_types = ["full_attention"] * 2
    cfg.block_size = BLOCK
    cfg.num_target_layers = L_TARGET
    dflash = {"target_layer_ids": LAYERS, "mask_token_id": MASK}
    if projector == "domino":
        shift, prefix = DOMINO[name]
        dflash |= {"projector_type": "domino", "emb_dim": 24, "gru_hidden_dim": 16,
                   "shift_label": shift, "pure_draft_prefix_len": prefix}  # fmt: skip
    if projector == "dspark":
        dflash |= {"projector_type": "dspark", "markov_rank": 8, "markov_head_type": "vanilla",
                   "confidence_head_alpha": 1.0, "attention_mode": "gqa"}  # fmt: skip
    cfg.dflash_config = dflash
    cfg._attn_implementation = "eager"
    return cfg


def ours_config(name: str):
    from specbus.core.models.dflash import DFlashConfig

    projector = projector_of(name)
    shift, prefix = DOMINO.get(name, (False, 0))
    return DFlashConfig(
        hidden_size=H, intermediate_size=64, num_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=V, target_layer_ids=LAYERS,
        num_target_layers=L_TARGET, block_size=BLOCK, mask_token_id=MASK, projector=projector,
        max_position_embeddings=256, emb_dim=24, gru_hidden_dim=16,
        markov_rank=8 if projector == "dspark" else 0, confidence_head=projector == "dspark",
        shift_label=shift, pure_draft_prefix_len=prefix,
    )  # fmt: skip


def make_batch(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = (24, 17, 9)
    seq = max(lengths)
    ids = torch.zeros(3, seq, dtype=torch.long)
    mask = torch.zeros(3, seq, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(2, V, (n,), generator=g)
        m = (torch.rand(n, generator=g) < 0.8).long()
        m[: n // 4] = 0  # a prompt
        mask[i, :n] = m
    aux = torch.randn(3, seq, len(LAYERS) * H, generator=g)
    final = torch.randn(3, seq, H, generator=g)
    for i, n in enumerate(lengths):  # padding is zeros, as collate makes it
        aux[i, n:] = 0
        final[i, n:] = 0
    return ids, mask, aux, final


def run(name: str, steps: int = 3, attention: str = "eager", fused: bool = False) -> Report:
    import torch
    from specbus.core.models.dflash import DFlashDraft
    from specbus.core.strategies.base import StepContext
    from specbus.core.strategies.dflash import (
        dflash_loss,
        domino_lambda,
        domino_loss,
        dspark_loss,
        sample_anchors,
    )
    from specforge.algorithms.common import dflash_family_model as ref_mod
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.modeling.draft.domino import DominoDraftModel
    from specforge.modeling.draft.dspark import DSparkDraftModel
    from specforge.training.strategies.base import linear_lambda_base

    report = Report(name)
    projector = projector_of(name)
    torch.manual_seed(0)
    ref_cls = {"dflash": DFlashDraftModel, "domino": DominoDraftModel, "dspark": DSparkDraftModel}
    ref_draft = ref_cls[projector](reference_config(name)).float()
    ours = DFlashDraft(ours_config(name))
    ref_state = {k: v for k, v in ref_draft.state_dict().items() if "rotary_emb" not in k}
    missing, unexpected = ours.load_state_dict(ref_state, strict=False)
    if missing or unexpected:
        raise SystemExit(
            f"{projector}: weight names differ: missing {missing}, unexpected {unexpected}"
        )
    embed = torch.nn.Embedding(V, H)
    head = torch.nn.Linear(H, V, bias=False)
    for p in (*embed.parameters(), *head.parameters()):
        p.requires_grad_(False)
    common = dict(
        draft_model=ref_draft, target_lm_head=head, target_embed_tokens=embed,
        mask_token_id=MASK, block_size=BLOCK, attention_backend="eager", num_anchors=ANCHORS,
        loss_decay_gamma=7.0, objective_chunk_blocks=2,
    )  # fmt: skip
    wrapper = {
        "dflash": lambda: ref_mod.OnlineDFlashModel(**common),
        "domino": lambda: ref_mod.OnlineDominoModel(
            **common, shift_label=DOMINO.get(name, (False, 0))[0]
        ),
        "dspark": lambda: ref_mod.OnlineDSparkModel(**common),
    }[projector]()
    ref_opt = torch.optim.AdamW([p for p in ref_draft.parameters() if p.requires_grad], lr=1e-2)
    our_opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-2)
    anchor_gen = torch.Generator().manual_seed(1234)
    total = 10
    for step in range(steps):
        ids, mask, aux, final = make_batch(step)
        anchors = sample_anchors(mask, ANCHORS, anchor_gen)
        wrapper._sample_anchor_positions = lambda seq_len, loss_mask, device, a=anchors: a
        kwargs = dict(
            input_ids_BL=ids, loss_mask_BL=mask, hidden_states_BLA=aux, embed_VH=embed.weight,
            lm_head_VH=head.weight, mask_token_id=MASK, block_size=BLOCK, num_anchors=ANCHORS,
            gamma=7.0, anchors=anchors, chunk_blocks=2, attention=attention,
        )  # fmt: skip
        if projector == "dflash":
            ref_loss, ref_acc, ref_m = wrapper(input_ids=ids, hidden_states=aux, loss_mask=mask)
            loss, m = dflash_loss(ours, **kwargs, fused=fused)
            ratios = ref_m["ratio_metrics"]
            report.check("accuracy", m["accuracy"], ratios["acc"][0] / ratios["acc"][1])
            report.check("loss_denom", m["loss_denom"], ref_m["loss_terms"][1])
        elif projector == "domino":
            ctx = StepContext(step, total)
            lam = domino_lambda(ctx)
            report.check("lambda_base", lam, linear_lambda_base(step, total, 1.0, 0.5))
            ref_loss, ref_acc, ref_m = wrapper(
                input_ids=ids, hidden_states=aux, loss_mask=mask, lambda_base=lam
            )
            loss, m = domino_loss(ours, **kwargs, lambda_base=lam)
            report.check("accuracy", m["accuracy"], ref_acc)
            for key in (
                "final_loss",
                "base_loss",
                "base_accuracy",
                "accept_len",
                "base_accept_len",
            ):
                report.check(key, m[key], ref_m[key])
        else:
            ref_loss, ref_acc, ref_m = wrapper(
                input_ids=ids, hidden_states=aux, loss_mask=mask, target_last_hidden_states=final
            )
            loss, m = dspark_loss(ours, **kwargs, target_BLH=final, fused=fused)
            ratios = ref_m["ratio_metrics"]
            report.check("accuracy", m["accuracy"], ref_acc)
            for key in ("ce_loss", "l1_loss", "confidence_loss", "confidence_abs_error",
                        "teacher_agreement", "teacher_top1_prob", "draft_top1_prob",
                        "tau_probabilistic"):  # fmt: skip
                num, den = ratios[key]
                report.check(key, m[key], num / den.clamp_min(1e-12))
            for ref_key, ours_key in (("ce_position", "ploss"), ("accuracy_position", "acc")):
                num, den = ratios[ref_key]
                ref_vec = num / den.clamp_min(1e-6)
                our_vec = torch.stack([m[f"{ours_key}_{j}"] for j in range(BLOCK)])
                report.check(f"{ours_key}_per_position", our_vec, ref_vec)
        report.check("loss", loss.detach(), ref_loss.detach())
        ref_opt.zero_grad()
        our_opt.zero_grad()
        ref_loss.backward()
        loss.backward()
        ref_params = dict(ref_draft.named_parameters())
        for name, p in ours.named_parameters():
            ref_grad = ref_params[name].grad
            report.check(
                "gradients", p.grad, ref_grad if ref_grad is not None else torch.zeros_like(p)
            )
        ref_opt.step()
        our_opt.step()
    ref_params = dict(ref_draft.named_parameters())
    for name, p in ours.named_parameters():
        report.check(f"weights after {steps} AdamW steps", p.detach(), ref_params[name].detach())
    return report


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--strategies", default="dflash,domino,domino-unshifted,domino-p0,dspark")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--attention",
        choices=("eager", "sdpa", "flex"),
        default="eager",
        help="specbus's attention path (the reference runs eager)",
    )
    ap.add_argument(
        "--fused",
        action="store_true",
        help="specbus's fused vocabulary head (the CUDA default; dflash and dspark)",
    )
    ap.add_argument("--json", default=None, help="write the worst errors here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    out, ok = {}, True
    for name in args.strategies.split(","):
        r = run(name, args.steps, args.attention, args.fused)
        out[name] = {"worst_relative_error": r.worst, "failures": r.failures}
        print(
            f"== {name} ({args.attention}{', fused' if args.fused else ''}): {'PASS' if not r.failures else 'FAIL'} (rtol {RTOL}, atol {ATOL})"
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
