"""The installed distribution of a serving engine (SGLang, vLLM): the first step of the layer
tools (`ops/sglang_layer.py`, `ops/vllm_layer.py`)."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path


def engine_dist(name: str, label: str, install: str, site: Path | None,
                error: type[Exception]) -> md.Distribution:  # fmt: skip
    """The distribution `name` installed in `site` (default: this interpreter's path);
    `error` naming `label` and the install command if none."""
    if site is not None:
        found = list(md.distributions(name=name, path=[str(site)]))
        if not found:
            raise error(f"{label} is not installed in {site}: {install}")
        return found[0]
    try:
        return md.distribution(name)
    except md.PackageNotFoundError as e:
        raise error(f"{label} is not installed here: {install}") from e
