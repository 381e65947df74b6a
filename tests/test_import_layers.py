"""Imports go one way (README, Layout): kernels and the leaf helpers (fxrewrite.nodes, source, tracer, trace_errors, tensor_state,
distributed, data_parallel, symm_all_reduce, errors, signature, meta_memo, hub_kernels, origin,
bound_forward, size_reads) <- fxrewrite.layers <- patterns <- the compiler (compiler, report, weights, sharding)
<- runtime <- fxrewrite.benchmarks <- the CLI, with no cycle, counting imports inside functions too (so none
can hide a cycle). Only the lazy facade, fxrewrite/__init__.py, reaches up (to runtime, on first use of LLM)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"fxrewrite": "fxrewrite", "patterns": "fxrewrite.patterns", "kernels": "fxrewrite.kernels",
           "runtime": "fxrewrite.runtime", "benchmarks": "fxrewrite.benchmarks"}
FACADE = "fxrewrite"
# Lowest first; a module may import its own layer and those below it.
_LEAVES = ("fxrewrite.kernels", "fxrewrite.nodes", "fxrewrite.source", "fxrewrite.distributed", "fxrewrite.data_parallel",
           "fxrewrite.symm_all_reduce",
           "fxrewrite.tracer", "fxrewrite.trace_errors", "fxrewrite.tensor_state", "fxrewrite.errors", "fxrewrite.signature", "fxrewrite.meta_memo",
           "fxrewrite.hub_kernels", "fxrewrite.origin", "fxrewrite.bound_forward", "fxrewrite.size_reads")
LAYERS = (_LEAVES, "fxrewrite.layers", "fxrewrite.patterns", "fxrewrite", "fxrewrite.runtime",
          "fxrewrite.benchmarks", "fxrewrite.cli")
_CLI = ("fxrewrite.cli", "fxrewrite.commands", "fxrewrite.__main__")


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `path` imports anywhere (module level, functions, TYPE_CHECKING blocks); the
    facade counts only where one of its lazy names (optimize, LLM, ...) is imported, not `__version__`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = {a.name for a in node.names} - ({"__version__"} if node.module == FACADE else set())
            subs = {f"{node.module}.{n}" for n in names} & known.keys()
            out |= subs
            if node.module in known and len(subs) < len(names):
                out.add(node.module)
    return out


def layer(module: str) -> int:
    if module.startswith(_CLI):
        return LAYERS.index("fxrewrite.cli")
    prefixes = [(p, i) for i, group in enumerate(LAYERS) for p in ((group,) if isinstance(group, str) else group)]
    return max((p for p in prefixes if module == p[0] or module.startswith(p[0] + ".")), key=lambda p: len(p[0]))[1]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items() if name != FACADE}


def test_layers_point_down():
    wrong = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
             for a, targets in graph().items() for b in targets if b != FACADE and layer(b) > layer(a)]
    assert not wrong, "\n".join(sorted(wrong))


def test_only_the_cli_uses_the_facade():
    users = sorted(a for a, targets in graph().items() if FACADE in targets and not a.startswith(_CLI))
    assert not users, f"import the module itself (fxrewrite.compiler, ...), not the facade: {users}"


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt in edges and not state.get(nxt):
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(edges):
        if not state.get(start):
            visit(start, [start])


def test_graph_sees_the_known_edges():
    """The checks above are only as good as the graph: spot-check edges that must be there."""
    edges = graph()
    assert "fxrewrite.compiler" in edges["fxrewrite.runtime.models.transformers_backend"]
    assert "fxrewrite.kernels.paged_decode" in edges["fxrewrite.kernels.paged_attention"]
    assert "fxrewrite.patterns.rotary_calls" in edges["fxrewrite.patterns.rotary"]
    assert "fxrewrite.nodes" in edges["fxrewrite.patterns.rotary"]
