"""Load a `specbus export --format speculators` directory with the real `speculators` 0.9.0.

Run by tests/test_speculators_export.py as `python -m tests.speculators_driver IN OUT` with the
pinned speculators on PYTHONPATH (tests/fixtures/vllm.py). Loads the directory with
`SpeculatorModel.from_pretrained` (speculators picks the class from the config's
`speculators_model_type`), runs its draft forward (eager attention, fp32) on the inputs the
test saved in IN (`input_ids`, `hidden_states`, `ttt_steps`), and saves to OUT each TTT step's
logits (read off its `lm_head`: its forward returns only the argmax tokens), the loaded class,
its config's layer ids and `norm_before_residual`, and its d2t/t2d buffers.

A DFlash or DSpark directory (IN has `anchors`), loaded in fp32 (its weights come from the
verifier's files unrounded, not through the bf16 the config names): speculators' own training forward runs with
the anchors pinned (the loss mask is 1 exactly at them and `max_anchors` is their count, so its
`select_anchors` picks them all, sorted) and its `compute_metrics` replaced by a catcher of
what the forward hands it: the block logits `[1, N*K, V]` (DSpark: after its Markov bias) and
DSpark's confidence logits `[1, N*K]`. Also saved: the loaded class, the tensor names the
checkpoint holds vs the model's own, the layer ids and `sample_from_anchor`.
"""

from __future__ import annotations

import sys

import torch


def main(inputs: str, output: str) -> None:
    from speculators import SpeculatorModel, SpeculatorModelConfig

    given = torch.load(inputs)
    path = given["path"]
    config = SpeculatorModelConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"  # not flex: CPU, reference
    if "anchors" in given:  # fp32 from the start: the verifier's heads it loads are not rounded
        model = SpeculatorModel.from_pretrained(path, config=config, dtype=torch.float32)
        return dflash_family(model.eval(), given, path, output)
    model = SpeculatorModel.from_pretrained(path, config=config).float().eval()
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach().clone()))
    ids = given["input_ids"]
    with torch.no_grad():
        tokens = model(hidden_states=given["hidden_states"], input_ids=ids,
                       document_ids=torch.zeros_like(ids), ttt_steps=given["ttt_steps"])  # fmt: skip
    hook.remove()
    torch.save({"class": type(model).__name__, "logits": logits, "tokens": tokens,
                "layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids),
                "norm_before_residual": model.config.norm_before_residual,
                "d2t": model.d2t, "t2d": model.t2d,
                "embed": model.embed_tokens.weight.detach().clone()}, output)  # fmt: skip


def dflash_family(model, given: dict, path: str, output: str) -> None:
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core
    from safetensors import safe_open

    caught: dict = {}

    def catch_dflash(logits, targets, loss_mask, *args, **kw):
        caught["logits"] = logits.detach().clone()
        return logits.sum() * 0, {}

    def catch_dspark(logits, targets, confidence, loss_mask, *args, **kw):
        caught["confidence"] = None if confidence is None else confidence.detach().clone()
        return catch_dflash(logits, targets, loss_mask)

    dflash_core.compute_metrics = catch_dflash  # the name each module's forward calls
    dspark_core.compute_metrics = catch_dspark
    ids, anchors = given["input_ids"], given["anchors"]
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, anchors] = 1
    verifier_last = torch.zeros(1, ids.shape[1], model.config.transformer_layer_config.hidden_size)
    with torch.no_grad():
        model(hidden_states=given["hidden_states"], input_ids=ids, loss_mask=loss_mask,
              verifier_last_hidden_states=verifier_last, document_ids=torch.zeros_like(ids),
              max_anchors=len(anchors))  # fmt: skip
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        saved = sorted(f.keys())
    ignored = set(model._keys_to_ignore_on_load_missing)
    torch.save({"class": type(model).__name__, **caught, "saved": saved,
                "expected": sorted(k for k in model.state_dict() if k not in ignored),
                "layer_ids": list(model.target_layer_ids),
                "sample_from_anchor": model.config.sample_from_anchor,
                "block_size": model.block_size,
                "embed": model.embed_tokens.weight.detach().clone(),
                "lm_head": model.lm_head.weight.detach().clone(),
                "speculative_tokens": model.config.speculators_config.proposal_methods[0].speculative_tokens}, output)  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
