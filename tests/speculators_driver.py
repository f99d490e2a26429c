"""Load a `specbus export --format speculators` directory with the real `speculators` 0.9.0.

Run by tests/test_speculators_export.py as `python -m tests.speculators_driver IN OUT` with the
pinned speculators on PYTHONPATH (tests/fixtures/vllm.py). Loads the directory with
`SpeculatorModel.from_pretrained` (speculators picks the class from the config's
`speculators_model_type`), runs its draft forward (eager attention, fp32) on the inputs the
test saved in IN (`input_ids`, `hidden_states`, `ttt_steps`), and saves to OUT each TTT step's
logits (read off its `lm_head`: its forward returns only the argmax tokens), the loaded class,
its config's layer ids and `norm_before_residual`, and its d2t/t2d buffers.
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


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
