"""`specbus train --from-recording DIR` on a vLLM `speculators` hidden-state dump directory.

The dump is made as speculators makes one: its rows by `datasets` (`save_to_disk`, in a
subprocess with the pinned speculators: tests/fixtures/vllm.py), its `hidden_states/hs_<i>`
files as vLLM's extract_hidden_states leaves them (aux layers in ascending order, then the last
layer pre-norm; here the real hidden states of the tiny target, computed by transformers), and
speculators' own trainer dataset reads it back. `--from-recording DIR` must open it as a
speculators dump and read the same values (the target feature is the last layer through the
target's final norm: transformers' post-norm state). Training from a recording is the same
`RecordingSource` whatever the format (tests/test_recording.py trains from a SpecForge dump).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from specbus.consumers.recording_formats import open_recording
from specbus.consumers.speculators import SpeculatorsRecording
from specbus.core.errors import ConfigError

from tests.fixtures.pipeline import pipeline_config, write_tokenised_data

ROOT = Path(__file__).resolve().parent.parent
N = 8
AUX = [0, 1, 2]  # specbus's layers (outputs); vLLM's ids 1, 2, 3, then the last layer (4)


def make_dump(root: Path, target: Path, env: dict) -> tuple[list[dict], list[torch.Tensor], list]:
    """(rows, transformers' post-norm states, speculators' reads) of an N-row dump in `root`."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    rows, finals = [], []
    (root / "hidden_states").mkdir(parents=True)
    for i in range(N):
        n = 20 + i
        ids = torch.randint(4, 100, (n,), generator=g)
        mask = [0] * 6 + [1] * (n - 6)
        taken: list = []  # the last decoder layer's output: the pre-norm last state
        hook = model.model.layers[-1].register_forward_hook(lambda m, a, o, t=taken: t.append(o))
        with torch.no_grad():
            out = model(ids[None], output_hidden_states=True)
        hook.remove()
        pre = taken[0][0] if isinstance(taken[0], tuple) else taken[0]
        # vLLM's id k is the state entering layer k: transformers' hidden_states[k] (k < L)
        states = [out.hidden_states[a + 1][0] for a in AUX] + [pre[0]]
        save_file({"hidden_states": torch.stack(states, dim=1).contiguous(), "token_ids": ids},
                  str(root / "hidden_states" / f"hs_{i}.safetensors"))  # fmt: skip
        rows.append({"input_ids": ids.tolist(), "loss_mask": mask})
        finals.append(out.hidden_states[-1][0])  # post-norm
    (root.parent / "rows.json").write_text(json.dumps(rows))
    proc = subprocess.run([sys.executable, "-m", "tests.speculators_dump", str(root),
                           str(root.parent / "rows.json"), str(root.parent / "read.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return rows, finals, torch.load(root.parent / "read.pt")


@pytest.mark.slow
def test_a_speculators_dump_reads_as_speculators_reads_it(speculators_env, tiny_target, run_id,
                                                          tmp_path):  # fmt: skip
    dump = tmp_path / "dump"
    rows, finals, theirs = make_dump(dump, tiny_target, speculators_env)
    data = write_tokenised_data(tmp_path / "data.jsonl", 2)
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data, store_uri="mem://",
                          overrides=[f"target.aux_layers={AUX}", "training.log_every=1"])  # fmt: skip
    # what `specbus train --from-recording DIR` opens
    rec = asyncio.run(open_recording(str(dump), None, cfg.strategy, cfg.target))
    assert isinstance(rec, SpeculatorsRecording) and rec.count == N
    assert rec.manifest.strategy == "eagle3" and rec.manifest.planned_tasks == N
    for i in range(N):
        sample_id, tokens, got = rec.sample(
            i, ("input_ids", "loss_mask", "hidden_states", "target")
        )
        assert (sample_id, tokens) == (f"hs_{i}", len(rows[i]["input_ids"]))
        assert got["input_ids"].tolist() == theirs[i]["input_ids"].tolist() == rows[i]["input_ids"]
        assert got["loss_mask"].tolist() == theirs[i]["loss_mask"].tolist() == rows[i]["loss_mask"]
        assert torch.equal(got["hidden_states"], theirs[i]["hidden_states"].float())
        # speculators' verifier_last_hidden_states normed as the model norms it
        torch.testing.assert_close(got["target"], finals[i], atol=1e-5, rtol=1e-5)
    # the run's aux layers must be the dump's, ascending
    with pytest.raises(ConfigError, match=r"distinct and ascending"):
        SpeculatorsRecording(
            dump, cfg.strategy, cfg.target.model_copy(update={"aux_layers": [2, 0, 1]})
        )
