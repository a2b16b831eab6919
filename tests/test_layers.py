"""The package's import graph: no loop, imports only go down the layers, lazy imports listed.

The layers, bottom up (``docs/reference/packages.md`` lists the same for users):

- base: errors, dtypes, config (the settings table), the heap, the version, progress, pinned
  memory, the engine's extension: every layer may import them;
- ``comm``: rendezvous, process groups, backends, collectives, the torch backend;
- ``compression``: gradient codecs, comm hooks;
- ``optim``: optimizers;
- ``parallel``: DDP, ZeRO, pipeline, tensor, replica strategies, recompute, ``distribute``;
- ``checkpoint``: save, load and reshard through the strategy contract;
- ``elastic``: in-memory commits, restore, re-forming the group;
- tools: ``launch``, ``cli``, ``data``, the package's ``__init__`` and the examples.

A module imports its own layer or one below. A function-level import is allowed only where
``LAZY`` says why; every other import sits at the top of its module, so the order in which
modules load is the order of the layers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "python" / "shardline"

LAYERS = [
    {
        "shardline._native",
        "shardline._pinned",
        "shardline._progress",
        "shardline._version",
        "shardline.config",
        "shardline.dtypes",
        "shardline.errors",
        "shardline.heap",
    },
    {"shardline.comm"},
    {"shardline.compression"},
    {"shardline.optim"},
    {"shardline.parallel"},
    {"shardline.checkpoint"},
    {"shardline.elastic"},
    {
        "shardline",
        "shardline.__main__",
        "shardline.cli",
        "shardline.data",
        "shardline.examples",
        "shardline.launch",
    },
]

# (importer, imported): why the import waits until a function runs.
LAZY = {
    ("shardline.cli", "shardline._native"): "the package works without the built engine",
    ("shardline.comm.backends.native", "shardline._native"): "the same: Gloo, NCCL, MPI need none",
    ("shardline.comm.trace.device", "shardline._native"): "the same: it reads through torch then",
    ("shardline.comm.trace.recorder", "shardline._native"): "the same: it writes with json then",
    ("shardline.comm", "shardline.comm.backends.native"): "a backend loads with its first group",
    ("shardline.comm", "shardline.comm.backends.gloo"): "a backend loads with its first group",
    ("shardline.comm", "shardline.comm.backends.nccl"): "a backend loads with its first group",
    ("shardline.comm", "shardline.comm.backends.mpi"): "MPI needs mpi4py, an optional package",
    ("shardline.comm.world", "shardline.comm.backends.mpi"): "MPI needs mpi4py (optional)",
    ("shardline.comm.world", "shardline.comm.backends.nccl"): "only a CUDA job needs NCCL",
    ("shardline.comm.rendezvous.generations", "shardline.comm.backends.nccl"): "only on CUDA",
    ("shardline.comm.tree", "shardline.comm.tree_cuda"): "needs Triton (torch's CUDA builds)",
    ("shardline.parallel.deterministic.layers", "shardline.parallel.deterministic.gpu_rows"): (
        "needs Triton (torch's CUDA builds)"
    ),
    (
        "shardline.parallel.deterministic.collector",
        "shardline.parallel.deterministic.gpu_products",
    ): "needs Triton (torch's CUDA builds)",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _target(name: str) -> str | None:
    """The module ``name`` refers to: itself, its package, or the extension."""
    if name in MODULES or name == "shardline._native":
        return name
    while "." in name:
        name = name.rsplit(".", 1)[0]
        if name in MODULES:
            return name
    return None


def _imports(module: str) -> Iterator[tuple[str, bool]]:
    """``(imported module, at function level)`` for each shardline import of ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]

    def walk(node: ast.AST, lazy: bool, typing_only: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only: never executed
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*up, base] if base else up)
                names = [f"{base}.{a.name}" if _target(f"{base}.{a.name}") else base
                         for a in child.names]  # fmt: skip
            else:
                inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
                yield from walk(child, inner, typing_only)
                continue
            for name in names:
                found = _target(name) if name.startswith("shardline") else None
                if found is not None and found != module:
                    yield found, lazy

    yield from walk(ast.parse(path.read_text()), False, False)


GRAPH = {m: sorted(set(_imports(m))) for m in MODULES}


def _layer(module: str) -> int:
    best = (-1, -1)  # (length of the matched prefix, layer)
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best[0]:
                best = (len(name), i)
    if best[1] < 0:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS (and DESIGN)")
    return best[1]


def test_the_graph_sees_the_whole_package() -> None:
    """The walk finds the imports it should (a broken walk would pass every test below)."""
    assert len(MODULES) > 120
    assert ("shardline.comm.group", False) in GRAPH["shardline.parallel.data.ddp"]
    assert ("shardline.comm.backends.mpi", True) in GRAPH["shardline.comm"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_go_down_the_layers(module: str) -> None:
    """Nothing below imports from above: comm knows no strategy, parallel no checkpoint."""
    mine = _layer(module)
    up = [(t, _layer(t)) for t, _ in GRAPH[module] if _layer(t) > mine and t != "shardline"]
    assert not up, (
        f"{module} (layer {mine}) imports from a layer above it: {up}; move the shared piece "
        "down, or have the upper layer tell the lower one (as elastic tells parallel.joining)"
    )


def test_function_level_imports_are_the_listed_ones() -> None:
    """A lazy import hides a loop or a slow start; each one here says why it must be lazy."""
    found = {(m, t) for m, ts in GRAPH.items() for t, lazy in ts if lazy}
    assert found - LAZY.keys() == set(), "import these at the top of the module, or list why"
    assert LAZY.keys() - found == set(), "these are no longer lazy: drop them from LAZY"


def test_no_import_loop() -> None:
    """Modules load in one order: no cycle, counting function-level imports too."""
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t, _ in GRAPH.get(m, []):
            if state.get(t) == 1:
                loop = [*path[path.index(t) :], t]
                raise AssertionError("import loop: " + " -> ".join(loop))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)
