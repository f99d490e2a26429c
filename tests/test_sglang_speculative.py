"""`specbus serve --engine sglang --speculative --dry-run` against the real SGLang 0.5.23 code.

The printed commands (capture layer flags plus SGLang's speculative flags with the run's
exported draft) are parsed by SGLang's own `prepare_server_args` (the pinned wheel, CPU
imports, `tests/fixtures/sglang.py`; one subprocess for the three strategies), and the
capture layer's startup check passes on the result. EAGLE3: a chain of k = 3 (topk 1, 4
tokens per verify) with the draft in the default `--draft-dir` (`<run_dir>/export`); DFLASH
(with the strategy's block size) and DSPARK (block size from the draft) given `--device cuda`,
what a GPU host detects (SGLang refuses these algorithms on a CPU device).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from specbus.core.config import dump_config
from specbus.core.data.vocab import VocabMapping

from tests.fixtures.live import live_config, write_chats

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # four subprocesses importing torch, one importing SGLang

CHECK = """import sys, json
from sglang.srt.server_args import prepare_server_args
from specbus.patches.sglang.plugin import check_server_args
out = []
for argv in json.loads(sys.argv[1]):
    a = prepare_server_args(argv)
    check_server_args(a)
    out.append([a.speculative_algorithm, a.speculative_draft_model_path, a.speculative_num_steps,
                a.speculative_eagle_topk, a.speculative_num_draft_tokens])
print(json.dumps(out))
"""


def exported_draft(cfg, out: Path) -> Path:
    """The run's untrained draft exported for SGLang (what `specbus export` writes)."""
    from specbus.core.export.dflash import export_dflash
    from specbus.core.export.sglang import export_draft
    from specbus.ops.reload import DraftLoader

    loader = DraftLoader(cfg, torch.device("cpu"), torch.float32)
    vocab = VocabMapping.from_d2t([0] * 64, 128) if loader.needs_vocab else None
    draft = loader.untrained(vocab).model
    return export_dflash(draft, out) if loader.block else export_draft(draft, out)


def dry_run(cfg, tmp_path: Path, *extra: str) -> list[str]:
    """The SGLang argv `specbus serve --engine sglang --speculative --dry-run` prints."""
    path = tmp_path / f"{cfg.strategy.name}.yaml"
    path.write_text(dump_config(cfg))
    out = subprocess.run([sys.executable, "-m", "specbus.ops.cli", "serve", "-c", str(path),
                          "--engine", "sglang", "--speculative", "--dry-run", *extra],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.strip().splitlines()[-1].split()
    return words[words.index("sglang.launch_server") + 1 :]


def test_the_speculative_commands_parse_with_real_sglang(sglang_env, chat_target, tmp_path):
    chats = write_chats(tmp_path / "c.jsonl")
    argvs, drafts = [], []
    for strategy in ("eagle3", "dflash", "dspark"):
        cfg = live_config("sgspec", tmp_path / strategy, chat_target, chats,
                          store_uri="shm://sgspec", strategy=strategy)  # fmt: skip
        if strategy == "eagle3":  # the default --draft-dir
            drafts.append(exported_draft(cfg, cfg.resolved_run_dir / "export"))
            argvs.append(dry_run(cfg, tmp_path))
        else:
            drafts.append(exported_draft(cfg, tmp_path / f"{strategy}-draft"))
            argv = dry_run(cfg, tmp_path, "--draft-dir", str(drafts[-1]))
            assert ("--speculative-dflash-block-size 4" in " ".join(argv)) == (strategy == "dflash")
            argvs.append([*argv, "--device", "cuda"])
    proc = subprocess.run([sys.executable, "-c", CHECK, json.dumps(argvs)], env=sglang_env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    eagle3, dflash, dspark = json.loads(proc.stdout.strip().splitlines()[-1])
    assert eagle3 == ["EAGLE3", str(drafts[0]), 3, 1, 4]
    assert dflash[:2] == ["DFLASH", str(drafts[1])]
    assert dspark[:2] == ["DSPARK", str(drafts[2])]
