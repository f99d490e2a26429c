"""`specbus vllm check`: is the installed vLLM the one the capture connector was built for?

The connector is loaded by module path from the server's `--kv-transfer-config`, so there is
nothing to apply or revert: `check` reads the installed vLLM without importing it (an AST of
the files, since importing vLLM needs its CUDA stack) and reports the version against the pin
(another version is refused by name) and every vLLM name the connector, its startup check and
the driven engine use (`NEEDS`), so a rename upstream is found before a server starts.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
from pathlib import Path

from specbus.core.errors import ConfigError
from specbus.ops.installed import engine_dist
from specbus.producers.engines.pins import VLLM_VERSION

INSTALL = f"pip install vllm=={VLLM_VERSION}"

# file (under vllm/) -> class ("*": module level) -> the names used: methods, fields (class
# annotations), attributes set in a method (`self.name = ...`), or module-level definitions.
NEEDS = {
    "distributed/kv_transfer/kv_connector/v1/base.py": {
        "KVConnectorBase_V1": ["__init__", "_vllm_config", "has_connector_metadata",
                               "_get_connector_metadata", "get_num_new_matched_tokens",
                               "update_state_after_alloc", "build_connector_meta",
                               "request_finished", "get_finished_count", "register_kv_caches",
                               "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                               "wait_for_save", "get_finished", "shutdown"],
        "SupportsHMA": ["request_finished_all_groups"],
        "*": ["KVConnectorMetadata", "KVConnectorRole"],
    },
    "distributed/kv_transfer/kv_connector/factory.py": {
        "KVConnectorFactory": ["get_connector_class"],
    },
    "config/kv_transfer.py": {
        "KVTransferConfig": ["kv_connector", "kv_connector_module_path", "kv_role"],
    },
    "config/vllm.py": {
        "VllmConfig": ["speculative_config", "scheduler_config", "cache_config",
                       "parallel_config", "model_config", "kv_transfer_config"],
        "*": ["get_layers_from_vllm_config"],
    },
    "config/speculative.py": {"SpeculativeConfig": ["method", "draft_model_config"]},
    "config/scheduler.py": {"SchedulerConfig": ["enable_chunked_prefill"]},
    "config/cache.py": {"CacheConfig": ["enable_prefix_caching"]},
    "config/parallel.py": {"ParallelConfig": ["pipeline_parallel_size"]},
    "config/model.py": {"ModelConfig": ["model", "get_total_num_hidden_layers"]},
    "v1/kv_cache_interface.py": {
        "KVCacheConfig": ["kv_cache_groups"], "KVCacheGroupSpec": ["kv_cache_spec"],
        "*": ["HiddenStateCacheSpec"],
    },
    "v1/request.py": {
        "Request": ["request_id", "prompt_token_ids", "output_token_ids", "kv_transfer_params",
                    "num_computed_tokens", "status"],
        "RequestStatus": ["FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"],
    },
    "distributed/parallel_state.py": {"*": ["get_tensor_model_parallel_rank"]},
    "model_executor/models/extract_hidden_states.py": {
        "*": ["CacheOnlyAttentionLayer", "ExtractHiddenStatesModel"],
    },
    "v1/spec_decode/extract_hidden_states.py": {"*": ["ExtractHiddenStatesProposer"]},
    # the layer-id convention the connector maps specbus's aux layers through (id k = the
    # hidden state entering layer k)
    "model_executor/models/interfaces.py": {
        "EagleModelMixin": ["_maybe_add_hidden_state", "aux_hidden_state_layers"],
    },
    # the driven engine's request (`producers/engines/vllm_server.py`)
    "entrypoints/openai/completion/protocol.py": {
        "CompletionRequest": ["prompt", "max_tokens", "temperature", "kv_transfer_params"],
    },
    # the speculators export (`core/export/speculators.py`) as vLLM reads it
    "transformers_utils/configs/speculators/algos.py": {"*": ["update_eagle3"]},
}  # fmt: skip


class LayerError(ConfigError):
    """The capture connector cannot run on the vLLM installed here."""


def vllm_dist(site: Path | None = None) -> md.Distribution:
    """The vLLM distribution installed in `site` (default: this interpreter's path);
    `LayerError` with the install command if none."""
    return engine_dist("vllm", "vLLM", INSTALL, site, LayerError)


def _class_names(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == "self"):  # fmt: skip
            names.add(node.attr)
    return names


def _module_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def missing_names(site: Path) -> list[str]:
    """What the connector uses and the installed source lacks ("file: Class.name"), by AST."""
    missing = []
    for rel, classes in NEEDS.items():
        path = site / "vllm" / rel
        if not path.is_file():
            missing.append(f"{rel}: the file")
            continue
        tree = ast.parse(path.read_text())
        found = {n.name: _class_names(n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for cls, names in classes.items():
            have = _module_names(tree) if cls == "*" else found.get(cls)
            if have is None:
                missing.append(f"{rel}: class {cls}")
                continue
            missing += [f"{rel}: {'' if cls == '*' else cls + '.'}{n}" for n in names
                        if n not in have]  # fmt: skip
    return missing


def check(site: Path | None = None) -> dict:
    """The connector's state here: vLLM's version against the pin and every name it uses.
    `ok` when both hold; `problems` names what does not (another version by name)."""
    try:
        dist = vllm_dist(site)
    except LayerError as e:
        return {"ok": False, "vllm": None, "pin": VLLM_VERSION, "problems": [str(e)]}
    site = site or Path(dist.locate_file("")).resolve()
    problems = []
    if dist.version != VLLM_VERSION:
        problems.append(f"vLLM {dist.version} is installed; the specbus capture connector is for "
                        f"vLLM {VLLM_VERSION} only ({INSTALL})")  # fmt: skip
    problems += [f"missing: {m}" for m in missing_names(site)]
    return {"ok": not problems, "vllm": dist.version, "pin": VLLM_VERSION, "site": str(site),
            "names_checked": sum(len(n) for c in NEEDS.values() for n in c.values()),
            "problems": problems}  # fmt: skip
