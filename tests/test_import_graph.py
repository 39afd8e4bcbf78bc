"""The package's import arrows (shared/DESIGN section 2): no cycle among modules, none among
folders, models free of the forward context and the native wing, the kernels package below
attention. Module-level imports only (`import` statements outside functions; TYPE_CHECKING
blocks excluded); a folder is a directory of pagedllm/ (pagedllm/native and
pagedllm/native/kernels are two). Run alone: `python -m pytest -q tests/test_import_graph.py`.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pagedllm

ROOT = Path(pagedllm.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _top_level_imports(module: str) -> set[str]:
    """The pagedllm modules `module` imports at module level."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                # `from package import submodule` needs the submodule, not the package's names
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in MODULES else base)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []) or [])
            elif isinstance(node, ast.ExceptHandler):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    targets = {_resolve(n) for n in found if n.startswith("pagedllm")}
    return {t for t in targets if t and t != module}


GRAPH = {m: _top_level_imports(m) for m in MODULES}


def _folder(module: str) -> str:
    return str(MODULES[module].parent.relative_to(ROOT.parent))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(graph):
        if v not in index:
            connect(v)
    return out


def test_no_module_import_cycle():
    assert _cycles(GRAPH) == []


def test_no_folder_import_cycle():
    folders: dict[str, set[str]] = defaultdict(set)
    for module, targets in GRAPH.items():
        folders[_folder(module)].update(_folder(t) for t in targets if _folder(t) != _folder(module))
    assert _cycles(folders) == []


def test_models_are_plain_definitions():
    forbidden = ("pagedllm.attention.forward_context", "pagedllm.attention.backends",
                 "pagedllm.native")
    for module, targets in GRAPH.items():
        if module.startswith("pagedllm.models"):
            bad = sorted(t for t in targets if t.startswith(forbidden))
            assert not bad, f"{module} imports {bad}"


def test_envs_is_a_leaf():
    """pagedllm/envs.py (every PAGEDLLM_* variable) imports no other pagedllm module, so any
    module, the kernels package included, may ask it."""
    assert GRAPH["pagedllm.envs"] == set()


def test_the_kernels_package_sits_below_attention():
    for module, targets in GRAPH.items():
        if module.startswith("pagedllm.native.kernels"):
            bad = sorted(t for t in targets if not t.startswith("pagedllm.native.kernels")
                         and t not in ("pagedllm.kv_cache_layout", "pagedllm.envs"))
            assert not bad, f"{module} imports {bad}"
