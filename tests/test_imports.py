"""The product packages' import structure, from their source (ast; nothing is imported):

- the module-level import graph of v41, custom_ops, passes and runtime has no cycle. Module level
  means what runs on import: top-level statements, class bodies, `if`/`try`/`with` blocks, but not
  function bodies (lazy imports), `if TYPE_CHECKING:` nor `if __name__ == "__main__":` blocks;
- the ops never import the model (custom_ops -> v41.model / v41.moe, at any level), and nothing
  custom_ops imports, even lazily, imports custom_ops back at module level (the reference impls
  live in leaves: v41/mhc.py, v41/moe_route.py, v41/engram/device.py);
- no product file is longer than MAX_LINES unless its module docstring has a line starting with
  "Size:" that says why, or it is in SPLIT_IN_PROGRESS.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("v41", "custom_ops", "passes", "runtime")
MAX_LINES = 450
# over MAX_LINES without a "Size:" reason; drop an entry once its file is split (the test says so)
SPLIT_IN_PROGRESS: set[str] = set()


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the product packages."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            parts = list(f.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


MODULES = _modules()


def _is_package(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def _skipped_if(node: ast.If) -> bool:
    t = node.test
    if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
            (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"):
        return True
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and len(t.comparators) == 1 and isinstance(t.comparators[0], ast.Constant)
            and t.comparators[0].value == "__main__")


def _import_nodes(tree: ast.AST, module_level: bool):
    """Import statements; with module_level, only those that run when the module is imported."""
    if not module_level:
        yield from (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        return
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            yield n
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(n, ast.If) and _skipped_if(n):
            todo.extend(n.orelse)
        else:
            todo.extend(ast.iter_child_nodes(n))


def _with_parents(mod: str) -> list[str]:
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _targets(mod: str, node) -> set[str]:
    """Product modules an import statement in `mod` runs: the named module and the packages above
    it (a package above `mod` itself is already running, so it is no edge), and for `from M import
    n` the submodule M.n when n is one."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = mod.split(".") if _is_package(mod) else mod.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            src = ".".join(base + ([node.module] if node.module else []))
        else:
            src = node.module
        subs = [f"{src}.{a.name}" for a in node.names if f"{src}.{a.name}" in MODULES]
        names = subs
        if len(subs) < len(node.names):      # some names are attributes of src itself
            names = names + [src]
    own = set(_with_parents(mod))
    out = set()
    for name in names:
        for m in _with_parents(name):
            if m in MODULES and m != mod and (m == name or m not in own):
                out.add(m)
    return out


def import_graph(module_level: bool = True) -> dict[str, set[str]]:
    graph = {}
    for mod, f in MODULES.items():
        tree = ast.parse(f.read_text(), str(f))
        graph[mod] = set().union(*(_targets(mod, n) for n in _import_nodes(tree, module_level)))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}          # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                c = visit(n)
                if c:
                    return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            c = visit(m)
            if c:
                return c
    return None


def _closure(graph, start) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for n in graph.get(m, ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_graph_sees_the_imports():
    # the parser finds what is there: a module-level edge, a package edge, a lazy (function) one
    g, lazy = import_graph(), import_graph(module_level=False)
    assert "v41.config" in g["v41.model"] and "custom_ops" in g["v41.moe"]
    assert "v41.loader.schema" in g["v41.loader"] and "v41.loader" not in g["v41.loader.load"]
    assert "v41.quant" in lazy["v41.loader.load"] and "v41.quant" not in g["v41.loader.load"]
    assert "v41.engram.hashing" not in g["v41.config"] and "v41.engram.hashing" in lazy["v41.config"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_level_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_ops_do_not_import_the_model():
    module_level, lazy = import_graph(), import_graph(module_level=False)
    ops = [m for m in MODULES if m == "custom_ops" or m.startswith("custom_ops.")]
    bad = [(m, t) for m in ops for t in sorted(lazy[m]) if t in ("v41.model", "v41.moe")]
    assert not bad, f"custom_ops imports the model: {bad}"
    # what the ops import, even lazily, does not import custom_ops back on import
    back = [(m, t) for m in ops for t in sorted(lazy[m]) if not t.startswith("custom_ops")
            and any(c == "custom_ops" or c.startswith("custom_ops.") for c in _closure(module_level, t))]
    assert not back, f"custom_ops imports modules that import custom_ops: {back}"


def _size_reason(f: Path) -> str | None:
    doc = ast.get_docstring(ast.parse(f.read_text(), str(f))) or ""
    return next((line for line in doc.splitlines() if line.strip().startswith("Size:")), None)


def test_file_sizes():
    over = {str(f.relative_to(REPO)): len(f.read_text().splitlines()) for f in MODULES.values()}
    over = {f: n for f, n in over.items() if n > MAX_LINES}
    unexplained = {f: n for f, n in over.items()
                   if f not in SPLIT_IN_PROGRESS and _size_reason(REPO / f) is None}
    print(f"files over {MAX_LINES} lines: {dict(sorted(over.items()))}")
    assert not unexplained, (f"over {MAX_LINES} lines without a 'Size:' line in the docstring: "
                             f"{unexplained} (all over: {over})")
    stale = {f for f in SPLIT_IN_PROGRESS if f not in over}
    assert not stale, f"no longer over {MAX_LINES} lines, drop from SPLIT_IN_PROGRESS: {stale}"
