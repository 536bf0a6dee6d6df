"""The house rules of the package layout, checked on the source (ast, no imports).

* The core (everything outside the backend packages) imports no backend: backends are
  installed in ``ftopt/__init__.py`` and reached through :mod:`ftopt.dispatch`.
* No import circles between ftopt's modules, and no import inside a function except of
  optional dependencies (an import hidden in a function is how circles hide).
* No module over 450 lines.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ftopt"
BACKENDS = ("ftopt.lowering", "ftopt.chunked")
COMPOSITION_ROOT = "ftopt"  # ftopt/__init__.py installs the backends
OPTIONAL = ("triton", "numpy")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _target(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if MODULES[module].name != "__init__.py":
            package = package[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
            for a in node.names]


def _imports() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    nested = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        in_functions = {id(n) for f in ast.walk(tree)
                        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for n in ast.walk(f)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _target(module, node):
                if id(node) in in_functions and not target.startswith(OPTIONAL):
                    nested.append((module, target, node.lineno))
                while target not in MODULES and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in MODULES and target != module:
                    edges[module].add(target)
    return edges, nested


EDGES, NESTED = _imports()


def _in(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_core_imports_no_backend():
    bad = sorted((m, t) for m, ts in EDGES.items() for t in ts
                 if m != COMPOSITION_ROOT and not _in(m, BACKENDS) and _in(t, BACKENDS))
    assert not bad, f"core modules importing a backend: {bad}"


def test_no_import_circles():
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in EDGES[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def test_no_imports_inside_functions():
    assert not NESTED, f"imports inside functions (module, target, line): {NESTED}"


def test_no_module_over_450_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"modules over 450 lines: {long}"


def test_the_checks_see_the_package():
    """The control: the graph holds the modules and edges it should."""
    assert "ftopt.lowering.entry" in MODULES and "ftopt.rule_transform" in MODULES
    assert "ftopt.rules" in EDGES["ftopt.rule_transform"]
    assert "ftopt.dispatch" in EDGES["ftopt.update"]
    assert {"ftopt.lowering", "ftopt.dispatch"} <= EDGES["ftopt"] | {"ftopt.lowering"}


def test_the_longest_first_files_exist():
    """conftest's LONGEST_FIRST names test files that exist (a renamed file would
    otherwise be handed out in its plain turn)."""
    import conftest

    tests = ROOT.parent / "tests"
    assert [name for name in conftest.LONGEST_FIRST if not (tests / name).is_file()] == []
