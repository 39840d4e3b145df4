"""Import rules: no circles among the library's modules (docs/design.md, "Who may import whom").

The checker reads the source, not the imported modules: every file that pyproject.toml's
`[tool.setuptools.package-dir]` installs under `miles_async.` is parsed with `ast`, and each
import statement anywhere in it (at the top, inside a function, under `if TYPE_CHECKING:`) is an
edge to the longest module it names. A lazy import does not break a circle: it only delays it.
A package's `__init__.py` is not a target (importing `miles_async.runtime` for a name it
re-exports counts as no edge), so the circles are between the modules that hold the code.

`KNOWN` lists the circles still open, written out; it may only shrink: a circle not in it fails
(a new one, or a known one that changed: one that shrank is written in smaller), and so does a
known one that no longer exists (take it out).
"""

from __future__ import annotations

import ast
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pyproject.toml gives Python 3.10 tomli, the same parser
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]

# The circles still open, each written out; it may only shrink (nothing may be added). The last
# two, closed beside this test, were the runtime's pieces reaching into ActorSystem (actor, child,
# control, dataplane, owner, refs, system under miles_async.runtime) and the engine's core and
# weight store importing each other (miles_async.engine.core, miles_async.engine.weights).
KNOWN: set[frozenset[str]] = set()


def library_modules(root: Path) -> dict[str, Path]:
    """Every module the package-dir mapping installs under `miles_async.`, by its import name."""
    package_dir: Mapping[str, str] = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    modules: dict[str, Path] = {}
    for package, folder in package_dir.items():
        if package != "miles_async" and not package.startswith("miles_async."):
            continue
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if any(part.startswith(".") or part == "__pycache__" for part in parts):
                continue
            name = ".".join([package, *(p for p in parts if p != "__init__")])
            modules.setdefault(name, path)  # a folder mapped twice (miles_async/x and x/): the first wins
    return modules


def _named(node: ast.Import | ast.ImportFrom, package: str) -> Iterator[str]:
    """The dotted names an import statement may refer to, relative ones made absolute."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        yield base
        yield from (f"{base}.{alias.name}" for alias in node.names)


def _imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in `body`, nested ones too; only statements hold statements, so this
    skips the expressions `ast.walk` would visit (a quarter of the test's time)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, None) or ():
                if isinstance(child, ast.stmt):
                    yield from _imports([child])
                elif isinstance(child, (ast.excepthandler, ast.match_case)):
                    yield from _imports(child.body)


def import_edges(modules: Mapping[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the first line that does}; packages' `__init__` are no target."""
    edges: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = edges[name] = {}
        for node in _imports(ast.parse(path.read_text(), str(path)).body):
            for target in _named(node, package):
                while target and target not in modules:  # the longest module the name is in
                    target = target.rpartition(".")[0]
                if target and target != name and modules[target].name != "__init__.py":
                    found.setdefault(target, node.lineno)
    return edges


def circles(edges: Mapping[str, Mapping[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def describe(circle: frozenset[str], edges: Mapping[str, Mapping[str, int]], modules: Mapping[str, Path]) -> str:
    """One circle, with the imports inside it (file:line) that make it."""
    lines = [f"circle: {' '.join(sorted(circle))}"]
    for name in sorted(circle):
        path = modules[name]
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        lines += [f"    {shown}:{line}: {name} -> {target}" for target, line in sorted(edges[name].items())
                  if target in circle]
    return "\n".join(lines)


def test_no_import_circles_but_the_known_ones() -> None:
    modules = library_modules(ROOT)
    assert "miles_async.actors.recipe" in modules and "miles_async.engine.core" in modules  # the mapping was read
    edges = import_edges(modules)
    found = set(circles(edges))
    new = found - KNOWN
    assert not new, ("import circles (move the names both sides need down into a module both can import; a "
                     "known circle that shrank: write the smaller one into KNOWN):\n"
                     + "\n".join(describe(c, edges, modules) for c in sorted(new, key=sorted)))
    gone = KNOWN - found
    assert not gone, ("closed: take out of KNOWN in tests/unit/test_import_rules.py: "
                      + "; ".join(" ".join(sorted(c)) for c in sorted(gone, key=sorted)))


def test_the_checker_finds_a_lazy_or_type_only_circle_and_ignores_packages(tmp_path: Path) -> None:
    # A small tree of its own (m. is miles_async.): m.a imports m.b at the top, m.b imports m.a in
    # a function's except clause (a circle); m.c imports m.d under TYPE_CHECKING, m.d imports m.c
    # relatively (a circle); m.e imports the package, whose __init__ imports m.e (no circle: an
    # __init__ is no target); the folder extra/ is installed as m.extra, its f imports m.a (one
    # way); other/ is not under miles_async. and is not read.
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent("""\
        [tool.setuptools.package-dir]
        "miles_async" = "miles_async"
        "miles_async.extra" = "extra"
        "other" = "other"
        """))
    files = {
        "miles_async/__init__.py": "from miles_async.e import thing\n",
        "miles_async/a.py": "from miles_async import b\n",
        "miles_async/b.py": "def later():\n    try:\n        pass\n    except ImportError:\n        import miles_async.a.deeper\n",
        "miles_async/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from miles_async.d import D\n",
        "miles_async/d.py": "from . import c\nD = 1\n",
        "miles_async/e.py": "import miles_async\nthing = 1\n",
        "extra/__init__.py": "",
        "extra/f.py": "from miles_async.a import x\n",
        "other/g.py": "import miles_async.extra.f\n",
    }
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    modules = library_modules(tmp_path)
    assert set(modules) == {"miles_async", "miles_async.a", "miles_async.b", "miles_async.c", "miles_async.d",
                            "miles_async.e", "miles_async.extra", "miles_async.extra.f"}
    edges = import_edges(modules)
    assert edges["miles_async.b"] == {"miles_async.a": 5}
    assert edges["miles_async.e"] == {}
    assert sorted(map(sorted, circles(edges))) == [["miles_async.a", "miles_async.b"],
                                                   ["miles_async.c", "miles_async.d"]]
