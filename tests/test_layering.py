"""The import graph of the product: every import counted, those inside functions too.
No cycles, and nothing imports upward (engine -> costmodel -> tiers; inside tiers, the
L3 backends never import the store above them). And the bench scripts import kvtier
(which loads OpenBLAS) before mlx."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("tiers", "costmodel", "engine")  # each may import only those before it (and itself)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(("kvtier",) + (parts[:-1] if parts[-1] == "__init__" else parts))


def imports(path: Path) -> set[str]:
    """The kvtier modules ``path`` imports anywhere in its body (relative ones resolved)."""
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            target = ".".join(p for p in (base, node.module or "") if p)
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names}  # `from . import x` names a module
    return {name for name in found if name.startswith("kvtier.")}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    paths = [p for top in LAYERS for p in (REPO / top).rglob("*.py")]
    modules = {module_name(p): p for p in paths}
    return {name: {m for m in imports(path) if m in modules and m != name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on.discard(w)
                component.append(w)
            on.discard(v)
            if component:
                out.append(sorted(component + [v]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_even_through_function_level_imports(graph):
    assert cycles(graph) == []


def test_nothing_imports_upward(graph):
    upward = [
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if LAYERS.index(b.split(".")[1]) > LAYERS.index(a.split(".")[1])
    ]
    assert upward == []


def test_the_l3_backends_and_the_record_codec_stay_below_the_store(graph):
    """``tiers.l3`` imports nothing of the hierarchy above it, and the record codec needs
    no device tier (so no mlx)."""
    l3 = {name: targets for name, targets in graph.items() if name.startswith("kvtier.tiers.l3")}
    above = {
        "kvtier.tiers.hierarchy",
        "kvtier.tiers.restore",
        "kvtier.tiers.placement",
        "kvtier.tiers.tier",
        "kvtier.tiers.join",
    }
    assert {name: targets & above for name, targets in l3.items() if targets & above} == {}
    assert graph["kvtier.tiers.l3.record"] <= {"kvtier.tiers.layout", "kvtier.tiers.l3.cipher"}
    assert not graph["kvtier.tiers.l3.cipher"]  # the cipher stands on nothing of kvtier


def test_the_server_stands_on_the_engine_never_on_the_cli(graph):
    """``engine.serve`` imports the engine's core; the CLI, above it, is never imported by it."""
    serve = {name: targets for name, targets in graph.items() if name.startswith("kvtier.engine.serve")}
    assert "kvtier.engine.serve.app" in serve
    assert {
        name: {t for t in targets if t.startswith("kvtier.engine.cli")}
        for name, targets in serve.items()
        if any(t.startswith("kvtier.engine.cli") for t in targets)
    } == {}


def top_level_imports(path: Path) -> list[str]:
    """The modules ``path`` imports at its top level, in order (not inside functions)."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.append(node.module or "")
    return names


@pytest.mark.parametrize("path", sorted((REPO / "bench").glob("*.py")), ids=lambda p: p.name)
def test_a_bench_imports_kvtier_before_mlx(path):
    """mlx binds its BLAS when first imported: a script that imports it before kvtier (which
    loads OpenBLAS) measures on mlx's reference BLAS, many times slower."""
    names = top_level_imports(path)
    first_mlx = next((i for i, n in enumerate(names) if n.split(".")[0] in ("mlx", "mlx_lm")), None)
    if first_mlx is not None:
        assert any(n.split(".")[0] == "kvtier" for n in names[:first_mlx]), names[: first_mlx + 1]
