"""The package imports one way (DESIGN.md 3): a lower layer never imports a higher one, so no
module of `flexmask` reaches itself through its imports. Imports inside functions count too:
they run, just later. The walk reads the source (ast), so it needs no GPU and imports nothing."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flexmask"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(importer: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` written in `importer`."""
    if level == 0:
        return target or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The flexmask modules that `name` imports, each `from x import y` counted as x.y where
    that is a module (a submodule import), else as x."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walk_sees_the_package():
    graph = import_graph()
    assert "flexmask.kernels.dispatch" in graph
    assert "flexmask.kernels.forward.portable" in graph["flexmask.kernels.dispatch"]
    assert "flexmask.masks.intervals" in graph["flexmask.masks.specs"]  # a lazy import, inside a method


def test_the_walk_finds_a_cycle():
    """The checker itself can fail: a cycle planted in a copy of the graph is reported."""
    graph = {k: set(v) for k, v in import_graph().items()}
    graph["flexmask.kernels.common.tiles"].add("flexmask.api")
    assert find_cycle(graph) is not None


def test_no_import_cycle_in_flexmask():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernels_never_import_the_layers_above():
    """kernels/ sits under masks' users: it may use nothing of api, autograd, varlen, masks'
    builders, distributed or integrations (the mask compiler's kernels use kernels/common)."""
    above = ("flexmask.api", "flexmask.autograd", "flexmask.varlen", "flexmask.masks", "flexmask.distributed",
             "flexmask.integrations")
    for name, deps in import_graph().items():
        if name.startswith("flexmask.kernels"):
            bad = sorted(d for d in deps if d.startswith(above))
            assert not bad, f"{name} imports {bad}"
