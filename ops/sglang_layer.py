"""`specbus sglang apply|check|revert`: put the capture plugin where an installed SGLang finds it.

`apply` writes one tiny distribution, `specbus_sglang_capture-<version>.dist-info`, into the
site-packages directory that holds SGLang: its `entry_points.txt` names the plugin
(`[sglang.srt.plugins] specbus_capture = specbus.patches.sglang.plugin:register`), its RECORD
lists the files written (so `revert`, or `pip uninstall specbus-sglang-capture`, removes
exactly them), and `specbus-layer.json` records the SGLang version and the hooked targets.
No SGLang file is touched. `apply` refuses another SGLang version than `SGLANG_VERSION` by
name, and a source where a hooked method or a field the hooks read is missing.

`check` reads the installed SGLang without importing it (an AST of the hooked files: imports
need CUDA-only packages on most machines) and reports what is there.

The plugin itself (`patches/sglang/plugin.py`) is never imported here: its module path, its
hooks and the pin come from `producers/engines/pins.py`.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.metadata as md
import json
import shutil
import time
from pathlib import Path

from specbus.core.errors import ConfigError
from specbus.ops.installed import engine_dist
from specbus.producers.engines.pins import PLUGIN_MODULE, SGLANG_HOOKS, SGLANG_VERSION

DIST = "specbus_sglang_capture"
ENTRY_POINT = f"specbus_capture = {PLUGIN_MODULE}:register"
INSTALL = f"pip install sglang=={SGLANG_VERSION}"

# file (under sglang/srt) -> class -> the names the hooks call or read in it: methods, fields
# (class annotations) or attributes set in a method (`self.name = ...`).
NEEDS = {
    "managers/schedule_batch.py": {
        "Req": ["__init__", "rid", "origin_input_ids", "output_ids", "return_hidden_states_mode",
                "finished_len", "is_retracted", "finished"],
        "ScheduleBatch": ["reqs", "prefix_lens", "return_hidden_states", "spec_algorithm"],
    },
    "managers/scheduler.py": {"Scheduler": ["__init__"]},
    "managers/scheduler_components/batch_result_processor.py": {
        "SchedulerBatchResultProcessor": ["process_batch_result_prefill",
                                          "process_batch_result_decode"],
    },
    "managers/utils.py": {"GenerationBatchResult": ["logits_output", "extend_input_len_per_req"]},
    "layers/logits_processor.py": {
        "LogitsProcessorOutput": ["hidden_states", "last_hidden_states",
                                  "hidden_states_token_indices"],
    },
    "arg_groups/fields/exec_.py": {
        "*": ["enable_return_aux_hidden_states", "return_aux_hidden_state_layer_ids"],
    },
    "plugins/hook_registry.py": {"HookRegistry": ["register", "apply_hooks"]},
}  # fmt: skip


class LayerError(ConfigError):
    """The layer cannot be applied here (another SGLang version, a missing hook target)."""


def sglang_dist(site: Path | None = None) -> md.Distribution:
    """The SGLang distribution installed in `site` (default: this interpreter's path);
    `LayerError` with the install command if none."""
    return engine_dist("sglang", "SGLang", INSTALL, site, LayerError)


def site_dir(dist: md.Distribution | None = None) -> Path:
    """The site-packages directory holding SGLang."""
    return Path((dist or sglang_dist()).locate_file("")).resolve()


def _names(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == "self"):  # fmt: skip
            names.add(node.attr)
    return names


def missing_targets(site: Path) -> list[str]:
    """What the hooks need and the installed source lacks ("file: Class.name"), by AST."""
    missing = []
    for rel, classes in NEEDS.items():
        path = site / "sglang" / "srt" / rel
        if not path.is_file():
            missing.append(f"{rel}: the file")
            continue
        tree = ast.parse(path.read_text())
        found = {n.name: _names(n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for cls, names in classes.items():
            have = set().union(*found.values()) if cls == "*" else found.get(cls)
            if have is None:
                missing.append(f"{rel}: class {cls}")
                continue
            missing += [f"{rel}: {cls}.{n}" for n in names if n not in have]
    return missing


def _dist_info(site: Path) -> Path:
    return site / f"{DIST}-{SGLANG_VERSION}.dist-info"


def _record_line(site: Path, path: Path) -> str:
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path.relative_to(site).as_posix()},sha256={digest},{len(data)}"


def apply(site: Path | None = None) -> dict:
    """Install the plugin's distribution next to SGLang (module doc); returns the record.
    Raises `LayerError` for another SGLang version or a missing hook target."""
    dist = sglang_dist(site)
    if dist.version != SGLANG_VERSION:
        raise LayerError(f"SGLang {dist.version} is installed; the specbus capture layer is "
                         f"for SGLang {SGLANG_VERSION} only ({INSTALL})")  # fmt: skip
    site = site or site_dir(dist)
    missing = missing_targets(site)
    if missing:
        raise LayerError("the installed SGLang lacks what the capture hooks need: "
                         + "; ".join(missing))  # fmt: skip
    info = _dist_info(site)
    if info.exists():
        shutil.rmtree(info)
    info.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: {DIST.replace('_', '-')}\n"
                    f"Version: {SGLANG_VERSION}\nSummary: specbus capture plugin for SGLang "
                    f"{SGLANG_VERSION} (written by `specbus sglang apply`)\n",
        "entry_points.txt": f"[sglang.srt.plugins]\n{ENTRY_POINT}\n",
        "INSTALLER": "specbus\n",
        "specbus-layer.json": json.dumps({
            "sglang": dist.version, "applied_at": time.time(), "entry_point": ENTRY_POINT,
            "targets": [f"{kind} {target}" for target, kind, _ in SGLANG_HOOKS],
        }, indent=1) + "\n",
    }  # fmt: skip
    for name, text in files.items():
        (info / name).write_text(text)
    lines = [_record_line(site, info / name) for name in files]
    (info / "RECORD").write_text("\n".join([*lines, f"{info.name}/RECORD,,"]) + "\n")
    return {"site": str(site), "dist_info": str(info), "files": [*files, "RECORD"],
            "sglang": dist.version}  # fmt: skip


def revert(site: Path | None = None) -> list[str]:
    """Remove the files `apply` wrote (from its RECORD); returns them ([] if not applied)."""
    site = site or site_dir(sglang_dist())
    info = _dist_info(site)
    record = info / "RECORD"
    if not record.is_file():
        return []
    removed = []
    for line in record.read_text().splitlines():
        rel = line.split(",")[0]
        path = (site / rel).resolve()
        if rel and path.is_file() and info.resolve() in path.parents:
            path.unlink()
            removed.append(rel)
    if info.is_dir() and not any(info.iterdir()):
        info.rmdir()
    return removed


def check(site: Path | None = None) -> dict:
    """The layer's state here: SGLang's version against the pin, missing hook targets,
    whether the plugin is applied and visible to SGLang's loader. `ok` when all hold."""
    try:
        dist = sglang_dist(site)
    except LayerError as e:
        return {"ok": False, "sglang": None, "problems": [str(e)]}
    site = site or site_dir(dist)
    problems = []
    if dist.version != SGLANG_VERSION:
        problems.append(f"SGLang {dist.version} is not {SGLANG_VERSION} ({INSTALL})")
    missing = missing_targets(site)
    problems += [f"missing: {m}" for m in missing]
    dists = md.distributions(path=[str(site)])
    eps = [ep for d in dists for ep in d.entry_points
           if ep.group == "sglang.srt.plugins" and ep.name == "specbus_capture"]  # fmt: skip
    if not eps:
        problems.append("not applied (`specbus sglang apply`)")
    return {"ok": not problems, "sglang": dist.version, "pin": SGLANG_VERSION,
            "site": str(site), "applied": bool(eps), "problems": problems}  # fmt: skip
