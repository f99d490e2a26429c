"""An offline hidden-state dump in SpecForge's layout, read as a recording (W1).

Format followed: the files SpecForge's `scripts/prepare_hidden_states.py` writes and its
offline datasets read (SpecForge 0.2.0: `specforge.data.preprocessing.OfflineEagle3Dataset`,
`process_offline_dflash_sample`, `runtime/data_plane/offline_reader.py`): one `torch.save`d
dict per sample, `<dir>/rows_<a>-<b>/data_<i>.ckpt` (or `.ckpt.gz`, gzip of the same), read in
the order of their sorted paths (SpecForge sorts them the same way, so epoch 0 visits them in
SpecForge's order).

| SpecForge key (shape) | specbus feature (shape) |
|---|---|
| `input_ids` ([L] or [1, L], int64) | `input_ids` [L] |
| `loss_mask` ([L] or [1, L]) | `loss_mask` [L] |
| EAGLE3: `aux_hidden_state` ([1, L, 3H]: the three auxiliary layers, concatenated) | `hidden_states` [L, 3H] |
| EAGLE3: `hidden_state` ([1, L, H]: the target's final hidden state) | `target` [L, H] |
| DFlash family: `hidden_states` ([L, W] or [1, L, W]) | `hidden_states` [L, W] |

SpecForge's loader truncates to its max length and zeroes the last loss-mask position; the
specbus collate does both (`data.max_length`). Files are loaded with `torch.load(...,
weights_only=True, mmap=True)`: tensors only (no arbitrary pickle), the large ones mapped
rather than read up front. The sample id is the file's path under the directory with `/`
written `:` (`rows_0-5000:data_12.ckpt`).

The manifest is derived: the target is the run config's (`target.model`, whose heads the
draft trains against), the vocab mapping is `vocab_mapping.pt` in the dump directory when
there is one (SpecForge's `{"d2t", "t2d"}`, the same offset convention as specbus) or else
built from the dump's supervised tokens, as the feeder builds it (one pass over the ids and
masks: mapped, so the hidden states are not read; a `.ckpt.gz` dump is decompressed for it).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import logging
import os
from pathlib import Path
from typing import Any

import torch
from specbus.consumers.recording import Recording
from specbus.core.config import StrategyConfig, TargetConfig
from specbus.core.contracts import Manifest, ManifestTarget, VocabTable
from specbus.core.data.vocab import build_vocab_mapping, count_tokens
from specbus.core.errors import ConfigError, FeatureMissing, IntegrityError
from specbus.core.models.target import load_target_info, resolve_target_dir, target_fingerprint

log = logging.getLogger("specbus.recording")

SUFFIXES = (".ckpt", ".ckpt.gz")
EAGLE3 = {"hidden_states": "aux_hidden_state", "target": "hidden_state"}
DFLASH = {"hidden_states": "hidden_states"}


def list_files(root: Path) -> list[Path]:
    """The dump's feature files, in SpecForge's order (sorted absolute paths)."""
    found = []
    for where, _dirs, names in os.walk(root):
        found += [os.path.join(where, n) for n in names if n.endswith(SUFFIXES)]
    return [Path(p) for p in sorted(os.path.abspath(p) for p in found)]


def load_file(path: Path) -> dict[str, Any]:
    """One feature file's dict (tensors only). Raises `FeatureMissing` when it is gone,
    `IntegrityError` when it cannot be read."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return torch.load(io.BytesIO(f.read()), weights_only=True, map_location="cpu")
        return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except FileNotFoundError as e:
        raise FeatureMissing(str(path)) from e
    except Exception as e:  # noqa: BLE001 - a torn or foreign file: the sample is unusable
        raise IntegrityError(f"{path}: not a readable SpecForge feature file: {e}") from e


class SpecForgeRecording(Recording):
    """A SpecForge dump directory read for `strategy` on `target` (see module doc). Raises
    `ConfigError` for a directory without feature files."""

    def __init__(self, root: Path, strategy_cfg: StrategyConfig, target_cfg: TargetConfig):
        self.root = Path(root).resolve()
        self.name = f"specforge:{self.root}"
        self.files = list_files(self.root)
        self.count = len(self.files)
        if not self.files:
            raise ConfigError(
                f"{self.root}: neither a specbus recording ({'recording.json'}) nor a SpecForge "
                f"dump (no {' / '.join(SUFFIXES)} files)"
            )
        strategy = strategy_cfg.name
        self.keys = EAGLE3 if strategy == "eagle3" else DFLASH
        path = resolve_target_dir(target_cfg.model)
        info = load_target_info(path, name=target_cfg.model)
        d2t = self._vocab(strategy_cfg.draft.draft_vocab_size, info.vocab_size)
        digest = hashlib.sha256()
        for f in self.files:
            digest.update(f"{f.relative_to(self.root)}:{f.stat().st_size}\n".encode())
        plan_hash = digest.hexdigest()[:16]
        self.manifest = Manifest(
            run=self.name,
            plan={"specforge_dump": str(self.root), "files": self.count},
            plan_hash=plan_hash,
            planned_tasks=self.count,
            target=ManifestTarget(
                model=target_cfg.model,
                fingerprint=target_fingerprint(path),
                tokenizer_fingerprint="none",
                num_layers=info.num_layers,
                hidden_size=info.hidden_size,
                vocab_size=info.vocab_size,
            ),
            strategy=strategy,
            vocab=VocabTable(d2t=tuple(d2t), target_vocab_size=info.vocab_size),
        )
        log.info("SpecForge dump %s: %d samples (%s)", self.root, self.count, strategy)

    def _vocab(self, draft_vocab: int, target_vocab: int) -> list[int]:
        given = self.root / "vocab_mapping.pt"
        if given.is_file():
            d2t = torch.load(given, weights_only=True)["d2t"]
            return [int(x) for x in d2t.tolist()]
        log.info("building the vocab mapping from the %d files of %s", self.count, self.root)

        def pairs():
            for f in self.files:
                raw = load_file(f)
                yield raw["input_ids"].reshape(-1), raw["loss_mask"].reshape(-1)

        mapping = build_vocab_mapping(
            count_tokens(pairs()), min(draft_vocab, target_vocab), target_vocab
        )
        return mapping.d2t.tolist()

    def sample(self, position: int, features: tuple[str, ...]):
        """(sample id, tokens, tensors) of the file at `position`, renamed to specbus's
        feature names. Raises `FeatureMissing` / `IntegrityError`."""
        path = self.files[position]
        raw = load_file(path)
        out: dict[str, torch.Tensor] = {}
        try:
            for name in features:
                if name in ("input_ids", "loss_mask"):
                    out[name] = raw[name].reshape(-1)
                    continue
                t = raw[self.keys.get(name, name)]
                out[name] = t.squeeze(0) if t.dim() == 3 and t.shape[0] == 1 else t
        except KeyError as e:
            raise IntegrityError(f"{path}: no {e} in the file (keys {sorted(raw)})") from e
        sample_id = str(path.relative_to(self.root)).replace(os.sep, ":")
        return sample_id, int(out["input_ids"].numel()) if "input_ids" in out else 0, out

    async def load(self, position, features):
        """`sample` off the event loop (see `Recording.load`)."""
        return await asyncio.to_thread(self.sample, position, features)
