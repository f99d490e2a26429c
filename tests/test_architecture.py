"""The layering is a contract: only bus/ imports nats; core/ imports neither bus nor a store client."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["core", "bus", "producers", "consumers", "ops"]


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at_module_level) for every import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, id(node) in top_level))
    return found


def _root(module: str) -> str:
    """The layer of a module: `specbus.bus.lease` -> `bus`; a third-party one -> its name."""
    parts = module.split(".")
    return parts[1] if parts[0] == "specbus" and len(parts) > 1 else parts[0]


# The bus benchmark's yardstick: plain nats-py, by definition not through bus/.


def test_only_bus_imports_nats():
    offenders = [
        f"{p.relative_to(ROOT)}: {m}"
        for pkg in PACKAGES
        if pkg != "bus"
        for p in (ROOT / pkg).rglob("*.py")
        for m, _ in _imports(p)
        if _root(m) == "nats"
    ]
    assert offenders == []


def test_core_imports_no_bus_and_no_store_client_at_module_level():
    offenders = []
    for p in (ROOT / "core").rglob("*.py"):
        for m, top in _imports(p):
            if _root(m) in {"bus", "producers", "consumers", "ops", "nats"}:
                offenders.append(f"{p.relative_to(ROOT)}: {m}")
            if _root(m) == "mooncake" and top:
                offenders.append(f"{p.relative_to(ROOT)}: {m} at module level")
    assert offenders == []


def test_producers_and_consumers_do_not_import_each_other():
    """Producers and consumers meet at core's protocols (`core.source.Source`), not each other;
    the composition roots in ops/ put them together."""
    offenders = [
        f"{p.relative_to(ROOT)}: {m}"
        for pkg, other in (("producers", "consumers"), ("consumers", "producers"))
        for p in (ROOT / pkg).rglob("*.py")
        for m, _ in _imports(p)
        if _root(m) == other
    ]
    assert offenders == []


def test_importing_core_loads_neither_nats_nor_mooncake():
    code = (
        "import sys, pkgutil, importlib, specbus.core as core\n"
        "for m in pkgutil.walk_packages(core.__path__, 'specbus.core.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = [n for n in sys.modules if n.split('.')[0] in ('nats', 'mooncake')"
        " or n.startswith('specbus.bus')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_producer_and_trainer_hosts_need_no_web_stack():
    """A GPU host runs `specbus produce` / `train` with the bus and torch only (ops/bench/gpu.sh
    installs no fastapi): the live intake's and server's web stack is imported where it serves."""
    code = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'starlette', 'httpx', 'aiohttp', 'openai'):\n"
        "    sys.modules[name] = None  # importing it raises\n"
        "import specbus.ops.cli, specbus.ops.train, specbus.ops.produce\n"
        "import specbus.producers.engines.hf, specbus.consumers.trainer\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_distribution_installs_one_top_level_name():
    """Installed, the folders are one namespace (`specbus.core`, `specbus.bus`, ...): nothing
    generic like `core` or `ops` lands in site-packages."""
    import importlib.metadata

    dist = importlib.metadata.distribution("specbus")
    assert dist.read_text("top_level.txt").split() == ["specbus"]
    code = "import importlib.util as u; assert u.find_spec('core') is None and u.find_spec('ops') is None"
    # What is installed, not a checkout on PYTHONPATH (the README's way to run one puts its
    # root there, where `core` is a folder).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/", env=env)


def test_no_flat_imports_remain():
    offenders = [
        f"{p.relative_to(ROOT)}: {m}"
        for pkg in [*PACKAGES, "tests"]
        for p in (ROOT / pkg).rglob("*.py")
        for m, _ in _imports(p)
        if m.split(".")[0] in PACKAGES
    ]
    assert offenders == []


def test_patches_is_a_leaf():
    """`patches/` is the code the serving engines load (SGLang's plugin, vLLM's connector); the
    library never imports it, not even deferred: what both sides share (the pins, the hooked
    methods, the module paths) is `producers/engines/pins.py`, the `apply`/`check` tools are ops/."""
    offenders = [
        f"{p.relative_to(ROOT)}: {m}{'' if top else ' (deferred)'}"
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        for m, top in _imports(p)
        if _root(m) == "patches"
    ]
    assert offenders == []


def test_the_engines_load_the_pinned_modules():
    """The names the engines load by (pins.py) are in patches/: SGLang's entry point
    `PLUGIN_MODULE:register` with every hook function of `SGLANG_HOOKS`, vLLM's
    `CONNECTOR_MODULE.CONNECTOR`. Read by AST: importing them needs the engines."""
    from specbus.producers.engines import pins

    def defined(module: str) -> set[str]:
        path = ROOT / Path(*module.split(".")[1:]).with_suffix(".py")
        return {n.name for n in ast.parse(path.read_text()).body if hasattr(n, "name")}

    plugin = defined(pins.PLUGIN_MODULE)
    assert {"register", *(hook for _, _, hook in pins.SGLANG_HOOKS)} <= plugin
    assert pins.CONNECTOR in defined(pins.CONNECTOR_MODULE)


def _function(path: Path, name: str) -> ast.FunctionDef:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{name} not found in {path}")


def test_the_composition_root_reads_in_a_screen_and_the_trainer_takes_built_parts():
    root = _function(ROOT / "ops" / "train.py", "run_trainer")
    assert root.end_lineno - root.lineno + 1 <= 60
    init = _function(ROOT / "consumers" / "trainer.py", "__init__")
    assert len(init.args.args) + len(init.args.kwonlyargs) <= 8


def test_no_library_file_is_above_500_lines():
    """One concern per file: a file past 500 lines in the layers is split by concern."""
    offenders = [
        f"{p.relative_to(ROOT)}: {n}"
        for pkg in ("core", "bus", "consumers", "producers")
        for p in (ROOT / pkg).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    ]
    assert offenders == []


def _module_graph(pkg: str) -> dict[str, dict[str, int]]:
    """`specbus.<pkg>` module -> {module of the same package it imports: line}, deferred
    (function-level) imports included, annotation-only ones (`if TYPE_CHECKING:`) not;
    `from specbus.x import y` counts `specbus.x.y` when y is a module."""
    files = {}
    for p in (ROOT / pkg).rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        files[".".join(("specbus", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = p
    graph: dict[str, dict[str, int]] = {}
    for module, p in files.items():
        if p.name == "__init__.py":  # a package's re-exports point down, never at a sibling
            continue
        tree = ast.parse(p.read_text(), filename=str(p))
        typing_only = {
            id(sub)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for sub in ast.walk(node)
        }
        edges = graph.setdefault(module, {})
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                if name in files and name != module:
                    edges.setdefault(name, node.lineno)
    return graph


def _a_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle of `graph` as ["a:line", "b:line", ...] (a imports b at line), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in graph.get(m, {}):
            if state.get(n) == 1:
                ring = path[path.index(n) :]
                return [f"{a}:{graph[a][b]}" for a, b in zip(ring, [*ring[1:], n], strict=True)]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_modules_inside_a_package_import_one_way():
    """No import cycle between the modules of a package, deferred imports included: a module
    borrowing a helper from one that imports it is a helper in the wrong module."""
    cycles = {pkg: _a_cycle(_module_graph(pkg)) for pkg in [*PACKAGES, "patches"]}
    assert {pkg: c for pkg, c in cycles.items() if c} == {}
