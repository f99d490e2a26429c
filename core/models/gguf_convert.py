"""The embedded target's GGUF -> bf16 safetensors conversion, with progress.

`convert_gguf(gguf, out, progress)` loads the GGUF with transformers (tokenizer, then weights,
de-quantised to fp32), rebuilds a plain model and saves it in bf16 with its tokenizer.
`progress(done, total, what)` (optional) hears how far it is: the steps are weighed in rough
seconds (`_STEPS`), with one report per de-quantised tensor; `done` never goes backwards and
ends at `total`. While a caller listens, transformers' own progress bars are off (its
per-tensor tqdm is replaced by the reports), so nothing else draws over the caller's bar.
`core/models/target.py` (`resolve_target_dir`) calls it once and caches the result.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

# progress(done, total, what)
Progress = Callable[[float, float, str], None]

# The conversion's steps and their seconds in one cold run on the 2-core machine under load
# (100 s in all; issue 17 saw 46-139 s): only their ratios matter, the ETA a caller shows comes
# from the measured speed. The weights are parsed from the GGUF twice (config, then tensors).
_STEPS = {
    "importing transformers": 7.0,
    "reading the tokenizer": 11.0,
    "reading the weights": 37.0,
    "de-quantising the tensors": 22.0,
    "rebuilding the model in bf16": 9.0,
    "writing safetensors": 3.0,
}


class _Steps:
    """Reports `_STEPS` to a `Progress`: `begin(step)` completes the steps before it,
    `within(fraction)` moves inside the current one. Never goes backwards."""

    def __init__(self, progress: Progress | None):
        self.progress, self.total = progress, sum(_STEPS.values())
        self.start, self.weight, self.what, self.done = 0.0, 0.0, "", 0.0

    def begin(self, what: str) -> None:
        names = list(_STEPS)
        self.start = sum(_STEPS[n] for n in names[: names.index(what)])
        self.weight, self.what = _STEPS[what], what
        self._report(self.start)

    def within(self, fraction: float) -> None:
        self._report(self.start + self.weight * min(max(fraction, 0.0), 1.0))

    def end(self) -> None:
        self.what = "converted"
        self._report(self.total)

    def _report(self, done: float) -> None:
        self.done = max(self.done, done)
        if self.progress is not None:
            self.progress(self.done, self.total, self.what)


_PATCH_LOCK = threading.Lock()  # one conversion at a time swaps transformers' tqdm


@contextmanager
def _tensor_progress(steps: _Steps) -> Iterator[None]:
    """While loading the GGUF weights, transformers' per-tensor tqdm bar is replaced by
    `steps` (one report per de-quantised tensor): no third-party bar, and a finer ETA."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # another transformers layout: the step-level reports remain
        yield
        return
    with _PATCH_LOCK:
        original = getattr(gguf_utils, "tqdm", None)

        def counted(iterable: Iterable, *_args, **_kwargs) -> Iterator:
            items = list(iterable)
            steps.begin("de-quantising the tensors")
            for i, item in enumerate(items, 1):
                yield item
                steps.within(i / len(items))

        gguf_utils.tqdm = counted
        try:
            yield
        finally:
            gguf_utils.tqdm = original


@contextmanager
def _hf_bars_off(off: bool) -> Iterator[None]:
    """transformers' own progress bars ("Loading weights", "Writing model shards") off while
    the block runs when `off`; their previous state restored after."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if off and was_on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if off and was_on:
            hf_logging.enable_progress_bar()


def convert_gguf(gguf: Path, out: Path, progress: Progress | None = None) -> None:
    """Dequantise the GGUF into a bf16 safetensors directory (config, weights, tokenizer),
    reporting to `progress` (module doc)."""
    steps = _Steps(progress)
    steps.begin("importing transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _hf_bars_off(progress is not None):
        steps.begin("reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.begin("reading the weights")
        with _tensor_progress(steps) if progress is not None else nullcontext():
            loaded = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        steps.begin("rebuilding the model in bf16")
        config = loaded.config
        # A GGUF-loaded model refuses save_pretrained (quantisation config): rebuild a plain one.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = "bfloat16"
        plain = type(loaded)(config)
        plain.load_state_dict(loaded.state_dict())
        steps.begin("writing safetensors")
        plain.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    steps.end()
