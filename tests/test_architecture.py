"""The package's shape, read from its source with ``ast`` (nothing is imported):

* no import cycle between convlower modules (imports inside functions count too);
* imports only go down the layers: tools/__main__ -> backend -> selection -> decompositions ->
  lowerings -> observe -> leaves (version, torch_internals, device, private_files);
* private torch (``torch._inductor``, ``torch._dynamo``, ``torch._guards``, ...) only in
  ``convlower/torch_internals.py`` and the parts it re-exports, its version fallbacks
  ``convlower/torch_versions.py``, Inductor's caches ``convlower/torch_caches.py`` and saved
  compiled functions ``convlower/torch_saved.py`` and kernel builds
  ``convlower/torch_kernel_batch.py`` and dispatcher helpers ``convlower/torch_dispatch.py``, which only ``torch_internals`` imports (the package does not know which torch it runs on);
* no module over 350 lines, no function over 60.

Each check is a function of a ``{module name: source}`` map, so the tests at the bottom can
feed it a small synthetic package and watch it fail.
"""
from __future__ import annotations

import ast
import functools
import pathlib
from dataclasses import dataclass

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "convlower"
ROOT_PKG = "convlower"

MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 60

# Layer of each top-level part of the package; a module may import its own layer or lower.
RANKS = {
    "version": 0, "torch_internals": 0, "torch_versions": 0, "torch_caches": 0,  # leaves
    "torch_saved": 0, "torch_kernel_batch": 0, "torch_dispatch": 0, "torch_direct": 0,
    "kernel_library": 0,
    "device": 0, "private_files": 0,
    "observe": 1,  # records, report, stats: a leaf group (over torch_internals)
    "lowerings": 2, "regions": 2,  # regions: a room of its own, the backend hands it a compiler
    "saved": 2,  # a room of its own: the warm-up hands it a backend and a context
    "decompositions": 3,
    "selection": 4,
    "backend": 5,
    "tools": 6, "__main__": 6,
}
FACE = ROOT_PKG  # convlower/__init__.py re-exports from anywhere

# The one module allowed to touch private torch, and the parts it re-exports (only INTERNALS
# and the parts themselves may import them): its per-torch-version fallbacks, Inductor's
# caches, saved compiles, kernel builds, dispatch and direct calls of compiled parts.
INTERNALS = f"{ROOT_PKG}.torch_internals"
VERSIONS = f"{ROOT_PKG}.torch_versions"
PARTS = (VERSIONS, f"{ROOT_PKG}.torch_caches", f"{ROOT_PKG}.torch_saved",
         f"{ROOT_PKG}.torch_kernel_batch", f"{ROOT_PKG}.torch_dispatch", f"{ROOT_PKG}.torch_direct")
# Private-looking torch names that are public API in practice.
ALLOWED_PRIVATE = {
    "torch._dynamo.mark_dynamic",  # documented way to mark a dimension dynamic
}


@dataclass(frozen=True)
class Module:
    name: str
    source: str
    is_package: bool  # an __init__.py

    @functools.cached_property
    def tree(self) -> ast.Module:
        return ast.parse(self.source, filename=self.name)


def load_package(directory: pathlib.Path = PACKAGE_DIR, root: str = ROOT_PKG) -> dict[str, Module]:
    modules = {}
    for path in sorted(directory.rglob("*.py")):
        parts = list(path.relative_to(directory).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join([root, *parts])
        modules[name] = Module(name, path.read_text(), is_package)
    return modules


def synthetic(sources: dict[str, str]) -> dict[str, Module]:
    """Modules from ``{"pkg.a": src}``; a name ending in ``.__init__`` is a package."""
    out = {}
    for name, src in sources.items():
        is_package = name.endswith(".__init__")
        name = name[: -len(".__init__")] if is_package else name
        out[name] = Module(name, src, is_package)
    return out


# -- the import graph -----------------------------------------------------------------------------

def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _nearest_known(name: str, known) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(mod: Module, known) -> list[tuple[str, int]]:
    """(imported package module, line) for every import anywhere in ``mod``.  ``from p import x``
    is an edge to ``p.x`` when that is a module, else to ``p``; no edge to parent packages
    (Python runs them first, but they are not what the module depends on)."""
    root = mod.name.split(".")[0]
    edges = []
    for node in ast.walk(mod.tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        for t in targets:
            if t.split(".")[0] != root:
                continue
            hit = _nearest_known(t, known)
            if hit and hit != mod.name:
                edges.append((hit, node.lineno))
    return edges


def import_graph(modules: dict[str, Module]) -> dict[str, dict[str, int]]:
    """``{module: {imported module: first line importing it}}``."""
    graph = {}
    for name, mod in modules.items():
        edges = graph[name] = {}
        for target, line in sorted(imports_of(mod, modules), key=lambda e: e[1]):
            edges.setdefault(target, line)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (as a closed path ``[a, b, ..., a]``) per strongly connected component."""
    index, low, on_stack, stack, sccs = {}, {}, set(), [], []

    def strong(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1 or v in graph.get(v, ()):
                sccs.append(set(scc))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return [_cycle_in(graph, scc) for scc in sccs]


def _cycle_in(graph, scc: set) -> list[str]:
    start = min(scc)
    paths, seen = [[start]], {start}
    while paths:  # breadth first: a shortest cycle through ``start``
        path = paths.pop(0)
        for w in sorted(graph.get(path[-1], ())):
            if w == start:
                return path + [start]
            if w in scc and w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"no cycle through {start} in {scc}")


def _format_cycle(graph, cycle) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + \
        f" -> {cycle[-1]}"


# -- layers ---------------------------------------------------------------------------------------

def rank_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) == 1:
        return None  # the package face
    return RANKS.get(parts[1])


def layer_violations(modules: dict[str, Module]) -> list[str]:
    graph = import_graph(modules)
    out = []
    for name in sorted(graph):
        if name == FACE:
            continue
        mine = rank_of(name)
        if mine is None:
            out.append(f"{name}: no layer; add its top-level name to RANKS in {__name__}")
            continue
        for target, line in sorted(graph[name].items()):
            theirs = rank_of(target) if target != FACE else max(RANKS.values()) + 1
            if theirs is not None and theirs > mine:
                out.append(f"{name} (line {line}) imports {target}: layer {theirs} above {mine}")
    return out


# -- private torch --------------------------------------------------------------------------------

def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _private(dotted: str) -> bool:
    """``torch._x...`` (not ``torch.__dunder__``), unless whitelisted."""
    parts = dotted.split(".")
    if len(parts) < 2 or parts[0] != "torch":
        return False
    if not parts[1].startswith("_") or (parts[1].startswith("__") and parts[1].endswith("__")):
        return False
    return not any(dotted == ok or dotted.startswith(ok + ".") for ok in ALLOWED_PRIVATE)


def private_torch_uses(mod: Module) -> list[str]:
    """Imports of private torch modules and ``torch._x`` attribute chains (through any alias
    of torch or of a torch module)."""
    tree = ast.parse(mod.source)
    aliases = {}  # local name -> the torch path it stands for
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    if _private(a.name):
                        out.add((node.lineno, f"import {a.name}"))
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                node.module.split(".")[0] == "torch":
            for a in node.names:
                if _private(f"{node.module}.{a.name}"):
                    out.add((node.lineno, f"from {node.module} import {a.name}"))
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue  # only whole chains: ``torch._dynamo.mark_dynamic``, not its prefixes
        dotted = _dotted(node)
        head, _, rest = (dotted or "").partition(".")
        if head in aliases and _private(f"{aliases[head]}.{rest}"):
            out.add((node.lineno, dotted))
    return [f"line {line}: {what}" for line, what in sorted(out)]


def private_violations(modules: dict[str, Module]) -> list[str]:
    graph = import_graph(modules)
    return [f"{name} {use}" for name, mod in sorted(modules.items())
            if name not in (INTERNALS, *PARTS) for use in private_torch_uses(mod)] + \
        [f"{name} (line {graph[name][part]}) imports {part}: only {INTERNALS} (and its parts) may"
         for name in sorted(graph) for part in PARTS
         if name not in (INTERNALS, *PARTS) and part in graph[name]]


# -- size -----------------------------------------------------------------------------------------

def size_violations(modules: dict[str, Module], max_module=MAX_MODULE_LINES,
                    max_function=MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for name, mod in sorted(modules.items()):
        n = len(mod.source.splitlines())
        if n > max_module:
            out.append(f"module {name}: {n} lines (> {max_module})")
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                if length > max_function:
                    out.append(f"function {name}.{node.name} (line {node.lineno}): "
                               f"{length} lines (> {max_function})")
    return out


# -- the checks on convlower ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def package():
    modules = load_package()
    assert f"{ROOT_PKG}.backend.compiler" in modules and INTERNALS in modules
    return modules


def test_no_import_cycles(package):
    graph = import_graph(package)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(_format_cycle(graph, c) for c in cycles)


def test_imports_follow_the_layers(package):
    bad = layer_violations(package)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_private_torch_only_in_torch_internals(package):
    bad = private_violations(package)
    assert not bad, f"private torch outside {INTERNALS}:\n" + "\n".join(bad)


def test_module_and_function_sizes(package):
    bad = size_violations(package)
    assert not bad, "too long:\n" + "\n".join(bad)


# -- the checks can fail --------------------------------------------------------------------------

def test_cycle_finder_finds_a_synthetic_cycle():
    mods = synthetic({
        "p.__init__": "from .a import f\nfrom . import c\n",  # a package importing its own: fine
        "p.a": "def f():\n    from p.b import g\n    return g()\n",  # inside a function counts
        "p.b": "from . import c\ndef g(): ...\n",
        "p.c": "from .a import f\n",
        "p.d": "import p.c\nimport os\n",
    })
    graph = import_graph(mods)
    assert graph["p"] == {"p.a": 1, "p.c": 2}  # `from . import c` is an edge to p.c, not to p
    assert graph["p.b"] == {"p.c": 1}
    cycles = find_cycles(graph)
    assert cycles == [["p.a", "p.b", "p.c", "p.a"]]
    assert _format_cycle(graph, cycles[0]) == "p.a (line 2) -> p.b (line 1) -> p.c (line 1) -> p.a"
    # and no false positive once the back edge is gone
    mods["p.c"] = Module("p.c", "import os\n", False)
    assert find_cycles(import_graph(mods)) == []


def test_self_and_parent_imports():
    mods = synthetic({"p.__init__": "from . import a\n", "p.a": "from . import b\n",
                      "p.b": "from . import helper_in_init\n"})
    graph = import_graph(mods)
    assert graph["p.b"] == {"p": 1}  # a name from the package's own __init__: a real cycle
    assert find_cycles(graph) == [["p", "p.a", "p.b", "p"]]


def test_layer_check_fails_on_an_upward_import():
    mods = synthetic({
        f"{ROOT_PKG}.__init__": "from .tools import zoo\n",  # the face: anything
        f"{ROOT_PKG}.lowerings.rule": "def f():\n    from ..backend import conv_pass\n",
        f"{ROOT_PKG}.backend.conv_pass": "from ..lowerings import rule\n",
        f"{ROOT_PKG}.tools.zoo": "from ..backend import conv_pass\n",
        f"{ROOT_PKG}.newthing": "",
    })
    assert layer_violations(mods) == [
        f"{ROOT_PKG}.lowerings.rule (line 2) imports {ROOT_PKG}.backend.conv_pass: layer 5 above 2",
        f"{ROOT_PKG}.newthing: no layer; add its top-level name to RANKS in {__name__}",
    ]


def test_private_torch_check_fails_outside_torch_internals():
    src = ("import torch\nimport torch as T\nimport torch._dynamo\nfrom torch._inductor import config\n"
           "from torch import _guards\nfrom torch.fx import Graph\n"
           "def f(x):\n    torch._dynamo.mark_dynamic(x, 0)\n    v = torch.__version__\n"
           "    T._prims_common.x(x)\n    return torch._C._get_tracing_state()\n")
    mods = synthetic({f"{ROOT_PKG}.backend.x": src, INTERNALS: src, VERSIONS: src,
                      f"{ROOT_PKG}.backend.y": "def f():\n    from .. import torch_versions\n"})
    assert private_violations(mods) == [
        f"{ROOT_PKG}.backend.x line 3: import torch._dynamo",
        f"{ROOT_PKG}.backend.x line 4: from torch._inductor import config",
        f"{ROOT_PKG}.backend.x line 5: from torch import _guards",
        f"{ROOT_PKG}.backend.x line 10: T._prims_common.x",
        f"{ROOT_PKG}.backend.x line 11: torch._C._get_tracing_state",
        f"{ROOT_PKG}.backend.y (line 2) imports {VERSIONS}: only {INTERNALS} (and its parts) may",
    ]
    # a part of the adapter may use another part
    parts = synthetic({f"{ROOT_PKG}.torch_saved": "from . import torch_direct\n",
                       f"{ROOT_PKG}.torch_direct": "import torch\n"})
    assert private_violations(parts) == []


def test_size_check_fails_on_long_code():
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    mods = synthetic({"p.a": f"@decorator\ndef f():\n{body}\n\n\nclass C:\n    def g(self):\n        pass\n"})
    assert size_violations(mods, max_module=12, max_function=7) == []  # 12 lines, f is 7
    assert size_violations(mods, max_module=11, max_function=7) == [
        "module p.a: 12 lines (> 11)"]
    assert size_violations(mods, max_module=12, max_function=6) == [
        "function p.a.f (line 2): 7 lines (> 6)"]  # decorators count
