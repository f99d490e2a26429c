"""The EAGLE3 TTT objective against a straightforward re-computation written here.

The reference below spells every step out position by position (its own RMSNorm, rotary,
attention over an explicit key list, teacher and metrics) and reads the draft's parameters as
plain tensors, so autograd gives both implementations' gradients on the same parameters.
"""

import math

import torch
import torch.nn.functional as F
from specbus.core.config import DraftConfig, StrategyConfig
from specbus.core.data.vocab import build_vocab_mapping
from specbus.core.models.target import TargetHeads, TargetInfo
from specbus.core.strategies import StepContext, build_strategy
from specbus.core.strategies.eagle3 import simulated_accept_length

V, H, LAYERS = 40, 16, 6
VD = 24


def tiny_target() -> TargetInfo:
    return TargetInfo(
        name="tiny",
        path=".",
        model_type="llama",
        num_layers=LAYERS,
        hidden_size=H,
        vocab_size=V,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        max_position_embeddings=64,
        rope_theta=1000.0,
    )


def setup(ttt_length=3, seed=0):
    torch.manual_seed(seed)
    target = tiny_target()
    heads = TargetHeads(embed_tokens=torch.randn(V, H), lm_head=torch.randn(V, H))
    cfg = StrategyConfig(ttt_length=ttt_length, draft=DraftConfig(draft_vocab_size=VD))
    strategy = build_strategy(cfg, target, heads=heads)
    lengths = (9, 6)
    samples = []
    for n in lengths:
        samples.append(
            {
                "input_ids": torch.randint(0, V, (n,)),
                "loss_mask": (torch.rand(n) > 0.25).long(),
                "hidden_states": torch.randn(n, 3 * H, dtype=torch.float64),
                "target": torch.randn(n, H, dtype=torch.float64),
            }
        )
    counts = {}
    for s in samples:
        for t in s["input_ids"].tolist():
            counts[t] = counts.get(t, 0) + 1
    from collections import Counter

    vocab = build_vocab_mapping(Counter(counts), VD, V)
    draft = strategy.build_model(vocab=vocab).double()
    with torch.no_grad():  # non-trivial norms
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    batch = strategy.collate(samples)
    strategy.heads = TargetHeads(heads.embed_tokens.double(), heads.lm_head.double())
    return strategy, draft, batch


# ------------------------------------------------------------------------------------------
# The straightforward reference


def rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta=1000.0):
    """Rotate pairs (x[i], x[i + D/2]) by pos * theta^(-2i/D)."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        angle = pos * theta ** (-2 * i / d)
        a, b = x[..., i], x[..., i + d // 2]
        out[..., i] = a * math.cos(angle) - b * math.sin(angle)
        out[..., i + d // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


def reference(draft, batch, lm_head, ttt_length, step_weight=0.8):
    p = dict(draft.named_parameters())
    t2d, d2t = draft.t2d, draft.d2t
    ids, attn, mask = (
        batch.tensors["input_ids"],
        batch.tensors["attention_mask"],
        batch.tensors["loss_mask"],
    )
    aux, tgt = batch.tensors["hidden_states"], batch.tensors["target"]
    B, L = ids.shape
    nh, nkv, hd = 4, 2, 4

    losses, accs, rates = [], [], []
    hidden = {(b, i): aux[b, i] @ p["fc.weight"].T for b in range(B) for i in range(L)}
    keys, values = {}, {}  # (step, b, i) -> [nh, hd]
    for k in range(ttt_length):
        new_hidden, step_loss, correct, denom, rate_num, rate_den = {}, 0.0, 0, 0, 0.0, 0.0
        for b in range(B):
            for i in range(L):
                token = int(ids[b, i + 1 + k]) if i + 1 + k < L else 0  # shifted once, then k more
                emb = draft.embed_tokens.weight[token]
                x = torch.cat(
                    [
                        rms(emb, p["midlayer.input_layernorm.weight"]),
                        rms(hidden[(b, i)], p["midlayer.hidden_norm.weight"]),
                    ]
                )
                q = (x @ p["midlayer.self_attn.q_proj.weight"].T).view(nh, hd)
                kk = (x @ p["midlayer.self_attn.k_proj.weight"].T).view(nkv, hd)
                vv = (x @ p["midlayer.self_attn.v_proj.weight"].T).view(nkv, hd)
                keys[(k, b, i)] = rope(kk, i + k).repeat_interleave(nh // nkv, 0)
                values[(k, b, i)] = vv.repeat_interleave(nh // nkv, 0)
                new_hidden[(b, i)] = (q, x)
        for b in range(B):
            for i in range(L):
                q, _ = new_hidden[(b, i)]
                q = rope(q, i + k)
                allowed = [(0, j) for j in range(i + 1) if attn[b, j] == 1] + [
                    (s, i) for s in range(1, k + 1)
                ]
                K = torch.stack([keys[(s, b, j)] for s, j in allowed], 1)  # [nh, n, hd]
                Vv = torch.stack([values[(s, b, j)] for s, j in allowed], 1)
                w = torch.softmax((q[:, None] * K).sum(-1) / math.sqrt(hd), -1)
                o = (w[..., None] * Vv).sum(1).reshape(-1) @ p["midlayer.self_attn.o_proj.weight"].T
                h1 = hidden[(b, i)] + o
                m = rms(h1, p["midlayer.post_attention_layernorm.weight"])
                h2 = (
                    h1
                    + (
                        F.silu(m @ p["midlayer.mlp.gate_proj.weight"].T)
                        * (m @ p["midlayer.mlp.up_proj.weight"].T)
                    )
                    @ p["midlayer.mlp.down_proj.weight"].T
                )
                new_hidden[(b, i)] = h2
                logits = rms(h2, p["norm.weight"]) @ p["lm_head.weight"].T
                # teacher at offset k on the once-shifted target hidden
                pos = i + 1 + k
                lm = int(mask[b, i + k]) if i + k < L else 0  # the loss mask is not pre-shifted
                if pos < L:
                    z = lm_head @ tgt[b, pos]
                else:  # the shifted-in zero hidden state (or beyond the sequence)
                    z = torch.zeros(V, dtype=lm_head.dtype) if i + k < L else None
                if z is not None:
                    target_id = int(z.argmax())
                    pm = lm * int(t2d[target_id])
                    tp = torch.softmax(z[t2d], -1)
                    tq = torch.softmax(z, -1)[t2d]
                else:
                    target_id, pm = 0, 0
                    tp, tq = (
                        torch.full((VD,), 1 / VD, dtype=logits.dtype),
                        torch.zeros(VD, dtype=logits.dtype),
                    )
                step_loss = step_loss - pm * (tp * torch.log_softmax(logits, -1)).sum()
                pred = int(logits.argmax())
                correct += lm * int(pred + int(d2t[pred]) == target_id)
                denom += lm
                rate_num += pm * float(torch.minimum(tq, torch.softmax(logits.detach(), -1)).sum())
                rate_den += pm
        hidden = new_hidden
        losses.append(step_loss / (B * L))
        accs.append(correct / max(denom, 1e-6))
        rates.append(rate_num / max(rate_den, 1e-8))
    total = sum(step_weight**k * step for k, step in enumerate(losses))
    return total, losses, accs, rates


def test_loss_metrics_and_gradients_match_a_straightforward_recomputation():
    strategy, draft, batch = setup(ttt_length=3)
    loss, metrics = strategy.forward_loss(draft, batch, StepContext())
    loss.backward()
    ours = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    draft.zero_grad()
    ref_total, ref_losses, ref_accs, ref_rates = reference(draft, batch, strategy.heads.lm_head, 3)
    ref_total.backward()
    torch.testing.assert_close(loss, ref_total, rtol=1e-9, atol=1e-10)
    for k in range(3):
        torch.testing.assert_close(
            metrics[f"ploss_{k}"], ref_losses[k].detach(), rtol=1e-9, atol=1e-10
        )
        assert float(metrics[f"acc_{k}"]) == ref_accs[k]
        assert abs(float(metrics[f"acceptance_rate_{k}"]) - ref_rates[k]) < 1e-9
    assert abs(metrics["sim_accept_len"] - simulated_accept_length(ref_accs)) < 1e-12
    for name, grad in ours.items():
        # rotary tables are fp32 (as the reference), so fp64 agreement stops near 1e-8
        torch.testing.assert_close(
            grad, dict(draft.named_parameters())[name].grad, rtol=1e-6, atol=1e-8, msg=name
        )


def test_gradient_reaches_every_trainable_parameter_and_never_the_frozen_embedding():
    strategy, draft, batch = setup(ttt_length=2)
    loss, _ = strategy.forward_loss(draft, batch, StepContext())
    loss.backward()
    for name, param in draft.named_parameters():
        if name == "embed_tokens.weight":
            assert not param.requires_grad and param.grad is None
        else:
            assert param.requires_grad and param.grad is not None and param.grad.abs().sum() > 0, (
                name
            )
    # The target lm_head is a plain tensor held by the strategy: never a parameter, never trained.
    assert not strategy.heads.lm_head.requires_grad
    assert all(p is not strategy.heads.lm_head for p in draft.parameters())


def test_step_weighting_is_geometric_in_the_ttt_position():
    strategy, draft, batch = setup(ttt_length=4)
    loss, metrics = strategy.forward_loss(draft, batch, StepContext())
    expected = sum(0.8**k * metrics[f"ploss_{k}"] for k in range(4))
    torch.testing.assert_close(loss.detach(), expected)


def test_collate_pads_right_zeroes_the_last_supervised_position_and_truncates():
    strategy, _, _ = setup()
    n1, n2 = 7, 4
    samples = [
        {
            "input_ids": torch.arange(n),
            "loss_mask": torch.ones(n, dtype=torch.long),
            "hidden_states": torch.ones(n, 3 * H),
            "target": torch.ones(n, H),
        }
        for n in (n1, n2)
    ]
    batch = strategy.collate(samples)
    t = batch.tensors
    assert t["input_ids"].shape == (2, n1) and t["hidden_states"].shape == (2, n1, 3 * H)
    assert t["attention_mask"].tolist() == [[1] * 7, [1] * 4 + [0] * 3]
    assert t["loss_mask"].tolist() == [[1] * 6 + [0], [1] * 3 + [0] * 4]
    assert t["target"][1, 4:].abs().sum() == 0 and t["input_ids"][1, 4:].tolist() == [0, 0, 0]
    assert (batch.num_samples, batch.num_tokens, batch.num_loss_tokens) == (2, 11, 9)
    short = strategy.collate(samples, max_length=5)
    assert short.tensors["input_ids"].shape == (2, 5) and short.tensors["loss_mask"][
        0
    ].tolist() == [1, 1, 1, 1, 0]


def test_collate_refuses_features_that_break_the_contract():
    from specbus.core.errors import CaptureError

    strategy, _, _ = setup()
    bad = {
        "input_ids": torch.arange(5),
        "loss_mask": torch.ones(5, dtype=torch.long),
        "hidden_states": torch.ones(5, 2 * H),
        "target": torch.ones(5, H),
    }
    try:
        strategy.collate([bad])
    except CaptureError as e:
        assert "hidden_states" in str(e)
    else:
        raise AssertionError("a [L, 2H] hidden_states was accepted")


def test_fused_step_loss_equals_the_reference_arithmetic():
    """The CUDA path's `_FusedStepLoss` (loss, acceptance rate and gradient from one pass)
    computes the same function as `step_loss` + `acceptance_rate` + autograd."""
    from specbus.core.strategies.eagle3 import eagle3_ttt_loss

    results = []
    for fused in (False, True):
        strategy, draft, batch = setup(ttt_length=3)
        t = batch.tensors
        loss, metrics = eagle3_ttt_loss(
            draft, input_ids_BL=t["input_ids"], attention_mask_BL=t["attention_mask"],
            loss_mask_BL=t["loss_mask"], hidden_states_BL3H=t["hidden_states"],
            target_BLH=t["target"], lm_head_VH=strategy.heads.lm_head, ttt_length=3,
            fused=fused,
        )  # fmt: skip
        (loss * 0.7).backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
        results.append((loss.detach(), metrics, grads))
    (loss_r, m_r, g_r), (loss_f, m_f, g_f) = results
    torch.testing.assert_close(loss_f, loss_r, rtol=1e-12, atol=1e-14)
    assert m_f.keys() == m_r.keys()
    for key in m_r:
        torch.testing.assert_close(
            torch.as_tensor(m_f[key]).double(), torch.as_tensor(m_r[key]).double(),
            rtol=1e-12, atol=1e-14, msg=key,
        )  # fmt: skip
    for name in g_r:
        torch.testing.assert_close(g_f[name], g_r[name], rtol=1e-10, atol=1e-13, msg=name)


def test_the_logit_teacher_and_the_fused_terms_compile_and_equal_eager():
    """What CUDA runs, compiled by Inductor on the CPU (a compile failure on the GPU would
    fall back to eager with a warning, unseen by a bench): the fused path's teacher (the bf16
    target logits at the draft columns, the two log-sum-exps, K padding rows) and each step's
    terms read from it equal their eager functions; the padding rows give target_p 1/Vd and
    target_p_on_draft 0 as `compute_teacher` pads them."""
    import math

    from specbus.core.strategies import eagle3, eagle3_fused

    torch.manual_seed(0)
    batch, seq, vocab, steps = 2, 37, 50, 3
    draft_ids = torch.sort(torch.randperm(vocab)[:20]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    target_logits = torch.randn(batch, seq, vocab).to(torch.bfloat16)
    loss_mask = (torch.rand(batch, seq, 1) > 0.3).int()
    teacher = torch.compile(eagle3_fused.logit_teacher_tensors.fn, dynamic=True)
    got = teacher(target_logits, t2d, loss_mask, steps, draft_ids)
    want = eagle3_fused.logit_teacher_tensors.fn(target_logits, t2d, loss_mask, steps, draft_ids)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    logits, lse_draft, lse_full = (t[:, seq:].float() for t in want[:3])
    torch.testing.assert_close(torch.exp(logits - lse_draft), torch.full_like(logits, 1 / 20))
    assert torch.equal(torch.exp(logits - lse_full), torch.zeros_like(logits))
    assert math.isclose(lse_draft[0, 0, 0].item(), math.log(20), rel_tol=1e-6)
    full = eagle3.compute_teacher(target_logits, t2d, loss_mask, steps)  # the reference's form
    rows = slice(0, seq + steps)
    torch.testing.assert_close(
        torch.exp(want[0][:, rows].float() - want[1][:, rows]), full.target_p_BLVd
    )
    torch.testing.assert_close(
        torch.exp(want[0][:, rows].float() - want[2][:, rows]), full.target_p_on_draft_BLVd
    )
    # all steps at once, as the fused path calls it: the teacher's rows of every step as
    # strided views of overlapping windows (`step_rows`), equal to each step's own call
    terms = torch.compile(eagle3_fused.ttt_step_terms.fn, dynamic=True)
    logits_K = torch.randn(steps, batch, seq, 20).to(torch.bfloat16)
    masks = torch.nn.functional.pad(want[4], (0, 0, 0, steps))
    rows = [eagle3_fused.step_rows(t, steps, seq) for t in (*want[:3], masks)]
    assert rows[0].data_ptr() == want[0].data_ptr()  # a view, no copy
    got_K = terms(logits_K, *rows)
    for a, b in zip(got_K, eagle3_fused.ttt_step_terms.fn(logits_K, *rows), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for k in range(steps):
        r = slice(k, k + seq)
        one = eagle3_fused.ttt_step_terms.fn(
            logits_K[k], want[0][:, r], want[1][:, r], want[2][:, r], masks[:, r]
        )
        for a, b in zip(one, got_K, strict=True):
            torch.testing.assert_close(a, b[k], rtol=1e-5, atol=1e-6)
