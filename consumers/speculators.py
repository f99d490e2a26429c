"""An offline hidden-state dump in vLLM `speculators`' layout, read as a recording (W1).

Format followed: what speculators 0.9's `prepare-data` and `generate-offline-data` write and
its trainer reads (`speculators.train.data.ArrowDataset` with `hs_connectors.FileTransfer`):
- `<dir>/`: the preprocessed rows, a `datasets` directory (`save_to_disk`: `state.json`
  listing Arrow stream files) with columns `input_ids` and `loss_mask` (and `seq_len`);
- `<dir>/hidden_states/hs_<i>.safetensors` for row `i`: `token_ids [L]` (checked against the
  row's `input_ids`, as speculators does) and `hidden_states [L, k + 1, H]`, the hidden states
  vLLM's `extract_hidden_states` captured: `k` aux layers in ascending layer order, then the
  last layer's output (pre-norm).

| speculators | specbus feature |
|---|---|
| row `input_ids`, `loss_mask` | `input_ids`, `loss_mask` |
| `hidden_states[:, :-1]` flattened (`[L, k * H]`) | `hidden_states` |
| `hidden_states[:, -1]` (`verifier_last_hidden_states`), through the target's final RMSNorm | `target` (EAGLE3; speculators norms it the same way in its loss) |

The dump does not record its layer ids: the run's `target.aux_layers` must name the same layers
(specbus's `a` is the dump's vLLM id `a + 1`), distinct and ascending, and their count must be
the dump's `k` (`ConfigError` / `IntegrityError` otherwise). Rows without an `hs_<i>` file (a
generation that skipped them) are not part of the recording. Sample ids are `hs_<i>`.
Reading the rows needs `pyarrow` (the `vllm` extra; `pip install pyarrow`). The vocab mapping is
built from the rows' supervised tokens, as the feeder builds it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from pathlib import Path

import torch
from specbus.consumers.recording import Recording
from specbus.core.config import StrategyConfig, TargetConfig
from specbus.core.contracts import Manifest, ManifestTarget, VocabTable
from specbus.core.data.vocab import build_vocab_mapping, count_tokens
from specbus.core.errors import ConfigError, FeatureMissing, IntegrityError
from specbus.core.models.kernels import rms_norm
from specbus.core.models.target import (
    load_final_norm,
    load_target_info,
    resolve_target_dir,
    target_fingerprint,
)

log = logging.getLogger("specbus.recording")

HIDDEN_DIR = "hidden_states"


def is_speculators_dump(root: Path) -> bool:
    """A speculators dump directory: its rows (`state.json`) and `hidden_states/`."""
    return (root / "state.json").is_file() and (root / HIDDEN_DIR).is_dir()


def read_rows(root: Path) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of every row of the dump's `datasets` directory, in order."""
    try:
        import pyarrow as pa
    except ImportError as e:
        raise ConfigError(f"{root}: reading a speculators dump needs pyarrow "
                          "(pip install 'specbus[vllm]' or pip install pyarrow)") from e  # fmt: skip
    try:
        state = json.loads((root / "state.json").read_text())
        rows = []
        for entry in state["_data_files"]:
            with pa.memory_map(str(root / entry["filename"])) as source:
                table = pa.ipc.open_stream(source).read_all()
            rows += zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist(),
                        strict=True)  # fmt: skip
    except (OSError, KeyError, ValueError, pa.ArrowException) as e:
        raise IntegrityError(f"{root}: not a readable speculators dataset: {e}") from e
    return rows


class SpeculatorsRecording(Recording):
    """A speculators dump directory read for `strategy` on `target` (module doc)."""

    def __init__(self, root: Path, strategy_cfg: StrategyConfig, target_cfg: TargetConfig):
        self.root = Path(root).resolve()
        self.name = f"speculators:{self.root}"
        rows = read_rows(self.root)
        files = {i: self.root / HIDDEN_DIR / f"hs_{i}.safetensors" for i in range(len(rows))}
        self.index = [i for i in range(len(rows)) if files[i].is_file()]
        if not self.index:
            raise ConfigError(f"{self.root}: a speculators dump without hidden states "
                              f"({HIDDEN_DIR}/hs_<i>.safetensors)")  # fmt: skip
        if len(self.index) < len(rows):
            log.warning("%s: %d of %d rows have no hidden states and are left out", self.root,
                        len(rows) - len(self.index), len(rows))  # fmt: skip
        self.rows, self.files, self.count = rows, files, len(self.index)
        path = resolve_target_dir(target_cfg.model)
        info = load_target_info(path, name=target_cfg.model)
        aux = list(target_cfg.aux_layers or [])
        if aux and (aux != sorted(set(aux))):
            raise ConfigError(f"target.aux_layers={aux}: a speculators dump holds vLLM's layers, "
                              "distinct and ascending; name them so (specbus's a is vLLM's a + 1)")  # fmt: skip
        self.norm = load_final_norm(path) if strategy_cfg.name == "eagle3" else None
        mapping = build_vocab_mapping(
            count_tokens((torch.tensor(rows[i][0]), torch.tensor(rows[i][1])) for i in self.index),
            min(strategy_cfg.draft.draft_vocab_size, info.vocab_size), info.vocab_size,
        )  # fmt: skip
        digest = hashlib.sha256()
        for i in self.index:
            digest.update(f"hs_{i}:{files[i].stat().st_size}\n".encode())
        self.manifest = Manifest(
            run=self.name,
            plan={"speculators_dump": str(self.root), "files": self.count},
            plan_hash=digest.hexdigest()[:16],
            planned_tasks=self.count,
            target=ManifestTarget(model=target_cfg.model, fingerprint=target_fingerprint(path),
                                  tokenizer_fingerprint="none", num_layers=info.num_layers,
                                  hidden_size=info.hidden_size, vocab_size=info.vocab_size),
            strategy=strategy_cfg.name,
            vocab=VocabTable(d2t=tuple(mapping.d2t.tolist()), target_vocab_size=info.vocab_size),
        )  # fmt: skip
        log.info("speculators dump %s: %d samples (%s)", self.root, self.count, strategy_cfg.name)

    def sample(self, position: int, features: tuple[str, ...]):
        """(sample id, tokens, tensors) of the dump's row at `position`, as specbus features.
        Raises `FeatureMissing` (the file is gone) / `IntegrityError` (unreadable, or its
        tokens are not the row's)."""
        from safetensors.torch import load_file

        i = self.index[position]
        path = self.files[i]
        try:
            raw = load_file(str(path))
        except FileNotFoundError as e:
            raise FeatureMissing(str(path)) from e
        except Exception as e:  # noqa: BLE001 - a torn or foreign file: the sample is unusable
            raise IntegrityError(
                f"{path}: not a readable speculators hidden-state file: {e}"
            ) from e
        ids, mask = self.rows[i]
        if "token_ids" not in raw or "hidden_states" not in raw or raw["token_ids"].tolist() != ids:
            raise IntegrityError(f"{path}: its token_ids / hidden_states are not row {i}'s")
        hidden = raw["hidden_states"]  # [L, k + 1, H]
        sources = {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "loss_mask": torch.tensor(mask, dtype=torch.long),
            "hidden_states": hidden[:, :-1].reshape(hidden.shape[0], -1),
        }
        if self.norm is not None:  # the model's own final norm (fp32 statistics)
            weight, eps = self.norm
            sources["target"] = rms_norm(hidden[:, -1], weight.to(hidden.dtype), eps)
        try:
            out = {name: sources[name] for name in features}
        except KeyError as e:
            raise IntegrityError(f"{path}: a speculators dump has no feature {e}") from e
        return f"hs_{i}", len(ids), out

    async def load(self, position, features):
        """`sample` off the event loop (see `Recording.load`)."""
        return await asyncio.to_thread(self.sample, position, features)
