"""The package's import graph is a DAG: no two units of nvfp4_jax import each other, not even
through an import inside a function. A unit is a subpackage (nvfp4_jax.quant, nvfp4_jax.train,
...) or a top-level module (nvfp4_jax.config, nvfp4_jax.sharding, ...); every import of the
package's source is read with `ast`, wherever in the module it sits."""

from __future__ import annotations

import ast
import pathlib

import nvfp4_jax

PACKAGE = pathlib.Path(nvfp4_jax.__file__).parent


def _unit(module: str) -> str:
    """nvfp4_jax.quant.dot -> nvfp4_jax.quant; nvfp4_jax.config -> nvfp4_jax.config."""
    return ".".join(module.split(".")[:2])


def _module_name(path: pathlib.Path) -> str:
    parts = ("nvfp4_jax",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: pathlib.Path, module: str) -> set[str]:
    """The nvfp4_jax modules `path` imports, at module level or inside any function."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.add(name)
            # `from nvfp4_jax import quant` imports the unit nvfp4_jax.quant.
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "nvfp4_jax" or name.startswith("nvfp4_jax.")}


def unit_graph() -> dict[str, set[str]]:
    """unit -> the other units it imports."""
    units = {_unit(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {u: set() for u in units if u != "nvfp4_jax"}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        source = _unit(module)
        if source == "nvfp4_jax":  # the package's own __init__ sits above everything
            continue
        for name in _imported(path, module):
            target = _unit(name)
            if target in graph and target != source:
                graph[source].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


# The layers of docs/design.md, bottom first: a unit imports units of lower layers only.
LAYERS = (
    ("nvfp4_jax.nvfp4_spec", "nvfp4_jax.bitwise", "nvfp4_jax.jax_window", "nvfp4_jax.cli"),
    ("nvfp4_jax.quant",),
    ("nvfp4_jax.config", "nvfp4_jax.kernels"),
    ("nvfp4_jax.sharding", "nvfp4_jax.model", "nvfp4_jax.data", "nvfp4_jax.flops", "nvfp4_jax.projection"),
    ("nvfp4_jax.train",),
    ("nvfp4_jax.convert", "nvfp4_jax.sample", "nvfp4_jax.plan", "nvfp4_jax.lab", "nvfp4_jax.federated",
     "nvfp4_jax.device_check"),
)


def test_the_units_of_the_package_import_each_other_without_a_cycle():
    graph = unit_graph()
    assert "nvfp4_jax.quant" in graph and "nvfp4_jax.train" in graph
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_unit_imports_only_the_layers_below_its_own():
    graph = unit_graph()
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    assert set(layer) == set(graph), "a unit missing from LAYERS (or gone): " + str(set(layer) ^ set(graph))
    upward = [(unit, target) for unit, targets in graph.items() for target in targets
              if layer[target] >= layer[unit]]
    assert not upward, upward


def test_every_function_local_import_says_why():
    """A function-local import is there for an optional dependency or to keep a config error ahead
    of importing jax (docs/design.md); a comment between the function's `def` and the import says
    which."""
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    before = lines[fn.lineno - 1:node.lineno]
                    if not any("#" in line for line in before):
                        unexplained.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not unexplained, unexplained
