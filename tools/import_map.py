"""Measure the imports between diag's modules: cycles, and imports that point up the layer table.

Usage (from anywhere; stdlib only, diag itself is never imported)::

    python tools/import_map.py              # summary, the cycles, the upward imports per module
    python tools/import_map.py --edges      # also every import between diag modules, with its line
    python tools/import_map.py --json       # the same facts as one JSON object
    python tools/import_map.py --contract   # the import-linter contract pyproject.toml must hold
    python tools/import_map.py --files foundations core   # the files of those layers (mypy --strict)

The layer of each module is read from the module table of ``ARCHITECTURE.md`` (rows
``| `name` | layer | job |``), so the document is the one place the intended layers are written.
Layers, lowest first: foundations, core, analysis, fix, report, cli. An import is *upward* when a
module imports one from a higher layer; imports within a layer are allowed (cycles are counted on
their own).

Each import of one diag module by another is classified by where it sits:

* ``top``: at module level (runs when the module is imported);
* ``lazy``: inside a function or method (runs when it is called);
* ``dynamic``: a string ``"diag.<module>"`` for ``importlib`` (the lazy table of ``diag/__init__.py``);
* ``typing``: under ``if TYPE_CHECKING:`` (never runs; listed, but not part of the graph).

``from diag import __version__`` (or ``import diag``) is an import of ``__init__``; imports of the
``diag.fixtures`` package (``fixtures/``) are outside diag/*.py and not counted.

A *cycle* is a strongly connected component of more than one module in the graph of ``top`` and
``lazy`` imports: an import inside a function is a dependency all the same (the function cannot run
without the other module); it only hides the cycle from Python's import machinery. ``dynamic``
imports (a name of ``__init__``'s lazy table loads its module only when that name is read, and a
static import checker does not see them) and ``typing`` imports (they never run) are listed but
left out of the graph and of the upward count. ``cycle modules`` is how many modules the cycles
hold. The numbers are written in ARCHITECTURE.md; ``tests/test_architecture.py`` checks them against
this script.

NOTE: this measures, it does not enforce. Issue 19 asks for an import-linter layers contract; these
numbers are its starting point, what that contract has to bring to zero.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("foundations", "core", "analysis", "fix", "report", "cli")
KINDS = ("top", "lazy", "dynamic", "typing")
_ROW = re.compile(r"^\|\s*`(?P<module>[A-Za-z_][A-Za-z0-9_]*)`\s*\|\s*(?P<layer>[a-z]+)\s*\|")
_DYNAMIC = re.compile(r"diag\.(?P<module>[A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class Import:
    """One import of a diag module by another, where it sits, and the line it is on."""

    importer: str
    imported: str
    kind: str
    line: int
    #: Names imported that are private to the other module (``from diag.match import _value_dtypes``).
    private: tuple[str, ...] = ()


@dataclass(frozen=True)
class ImportMap:
    """What the script measures: the imports, the cycles they form and the upward ones."""

    modules: list[str]
    layers: dict[str, str]
    imports: list[Import]
    cycles: list[list[str]]
    upward: list[Import]
    #: The cycles that remain once every upward import is gone: cycles within one layer.
    layer_cycles: list[list[str]]
    #: Imports of other packages inside functions: ``{"importer", "line", "package"}``.
    lazy_external: list[dict[str, object]]

    @property
    def unlisted(self) -> list[str]:
        """Modules of diag/ that ARCHITECTURE.md's table does not place in a layer."""
        return [m for m in self.modules if m not in self.layers]

    @property
    def cycle_modules(self) -> int:
        return sum(len(c) for c in self.cycles)

    @property
    def upward_pairs(self) -> list[tuple[str, str]]:
        """Distinct (importer, imported) upward pairs: five imports of one module count once."""
        return sorted({(i.importer, i.imported) for i in self.upward})

    def count(self, kind: str) -> int:
        return sum(1 for i in self.imports if i.kind == kind)

    def to_json(self) -> dict[str, object]:
        return {
            "modules": self.modules,
            "layers": self.layers,
            "unlisted": self.unlisted,
            "counts": {kind: self.count(kind) for kind in KINDS},
            "cycle_count": len(self.cycles),
            "cycle_modules": self.cycle_modules,
            "cycles": self.cycles,
            "upward_imports": len(self.upward),
            "upward_pairs": [list(p) for p in self.upward_pairs],
            "upward": [asdict(i) for i in self.upward],
            "layer_cycles": self.layer_cycles,
            "imports": [asdict(i) for i in self.imports],
            "lazy_external": self.lazy_external,
        }


def package_modules(package: Path) -> list[str]:
    """The module names of ``package/*.py`` (``__init__`` and ``__main__`` included), sorted."""
    return sorted(p.stem for p in package.glob("*.py"))


def layer_table(doc: Path) -> dict[str, str]:
    """Module -> layer from the rows of ARCHITECTURE.md's module table (empty if there is no doc)."""
    if not doc.is_file():
        return {}
    table: dict[str, str] = {}
    for line in doc.read_text(encoding="utf-8").splitlines():
        m = _ROW.match(line)
        if m and m["layer"] in LAYERS:
            table[m["module"]] = m["layer"]
    return table


def _targets(node: ast.Import | ast.ImportFrom, modules: set[str]) -> list[str]:
    """The diag modules one import statement loads (``from diag import files`` loads ``files``)."""
    if isinstance(node, ast.Import):
        found: list[str] = []
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == "diag":
                found.append(parts[1] if len(parts) > 1 else "__init__")
        return [m for m in found if m in modules]
    base = f"diag.{node.module or ''}".rstrip(".") if node.level == 1 else node.module or ""
    parts = base.split(".")
    if parts[0] != "diag":
        return []
    if len(parts) > 1:  # "from diag.x import y"; diag.fixtures is not a diag/*.py module
        return [parts[1]] if parts[1] in modules else []
    # "from diag import x": a module, or a name defined in diag/__init__.py
    return [alias.name if alias.name in modules else "__init__" for alias in node.names]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_imports(path: Path, modules: set[str]) -> list[Import]:
    """Every import of another diag module in one file, classified top / lazy / dynamic / typing."""
    importer = path.stem
    found: list[Import] = []

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            private: tuple[str, ...] = ()
            if isinstance(node, ast.ImportFrom):
                private = tuple(a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__"))
            found.extend(
                Import(importer, t, kind, node.lineno, private) for t in _targets(node, modules) if t != importer
            )
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and kind != "typing":
            m = _DYNAMIC.fullmatch(node.value)
            if m and m["module"] in modules and m["module"] != importer:
                found.append(Import(importer, m["module"], "dynamic", node.lineno))
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == "top":
            kind = "lazy"
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                visit(stmt, "typing")
            for stmt in node.orelse:
                visit(stmt, kind)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, kind)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "top")
    return found


def lazy_external(path: Path) -> list[dict[str, object]]:
    """Imports of other packages placed inside a function (``import onnxruntime as ort`` in a method)."""
    found: list[dict[str, object]] = []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                package = name.split(".")[0]
                if package != "diag":
                    found.append({"importer": path.stem, "line": node.lineno, "package": package})
    unique = {(f["importer"], f["line"], f["package"]): f for f in found}  # nested functions are walked twice
    return sorted(unique.values(), key=lambda f: (str(f["importer"]), int(str(f["line"]))))


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop(0)
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return sorted(components, key=lambda c: (-len(c), c))


def import_map(root: Path = ROOT) -> ImportMap:
    """Measure diag/*.py under ``root`` against the layer table of ``root/ARCHITECTURE.md``."""
    package = root / "diag"
    modules = package_modules(package)
    layers = layer_table(root / "ARCHITECTURE.md")
    imports = [imp for name in modules for imp in module_imports(package / f"{name}.py", set(modules))]
    graph: dict[str, set[str]] = {name: set() for name in modules}
    counted = [imp for imp in imports if imp.kind in ("top", "lazy")]
    for imp in counted:
        graph[imp.importer].add(imp.imported)
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = [
        imp
        for imp in counted
        if imp.importer in layers and imp.imported in layers and rank[layers[imp.imported]] > rank[layers[imp.importer]]
    ]
    within: dict[str, set[str]] = {name: set() for name in modules}
    for imp in counted:
        if imp not in upward:
            within[imp.importer].add(imp.imported)
    layer_cycles = [c for c in strongly_connected(within) if len(c) > 1]
    external = [f for name in modules for f in lazy_external(package / f"{name}.py")]
    return ImportMap(modules, layers, imports, cycles, upward, layer_cycles, external)


def summary(facts: ImportMap, edges: bool = False) -> list[str]:
    """The lines the script prints: counts, each cycle, upward imports grouped by importing module."""
    counts = ", ".join(f"{facts.count(kind)} {kind}" for kind in KINDS)
    pairs = {(i.importer, i.imported) for i in facts.imports if i.kind in ("top", "lazy")}
    lines = [
        f"modules: {len(facts.modules)}",
        f"imports between diag modules: {len(facts.imports)} ({counts}); {len(pairs)} top or lazy module pairs",
        f"cycles: {len(facts.cycles)}",
        f"cycle modules: {facts.cycle_modules}",
    ]
    for c in facts.cycles:
        lines += textwrap.wrap(f"cycle of {len(c)}: {', '.join(c)}", 96, initial_indent="  ", subsequent_indent="    ")
    lines.append(f"upward imports: {len(facts.upward)}")
    lines.append(f"upward module pairs: {len(facts.upward_pairs)}")
    by_importer: dict[str, list[str]] = {}
    for importer, imported in facts.upward_pairs:
        by_importer.setdefault(importer, []).append(imported)
    for importer, targets in sorted(by_importer.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        where = ", ".join(f"{t} ({facts.layers[t]})" for t in targets)
        lines.append(f"  {importer} ({facts.layers[importer]}) -> {len(targets)}: {where}")
    private = [i for i in facts.imports if i.private]
    lines.append(f"imports of private names from another module: {sum(len(i.private) for i in private)}")
    lines += [f"  {i.importer}:{i.line} <- {i.imported}.{', '.join(i.private)}" for i in private]
    lines.append(f"cycles left without the upward imports: {len(facts.layer_cycles)}")
    lines += [f"  within one layer: {', '.join(c)}" for c in facts.layer_cycles]
    if facts.unlisted:
        lines.append(f"not in ARCHITECTURE.md's module table: {', '.join(facts.unlisted)}")
    if edges:
        lines.append("imports:")
        lines += [f"  {i.importer}:{i.line} -> {i.imported} [{i.kind}]" for i in facts.imports]
    return lines


def contract(layers: dict[str, str]) -> str:
    """The ``[tool.importlinter]`` section that enforces the table's layers, as pyproject.toml holds it.

    One ``layers`` contract (highest layer first; the modules of one layer may import each other,
    ``:``) that is exhaustive over diag's modules, so a new module must be placed in a layer, and one
    ``acyclic_siblings`` contract, so the modules of one layer do not form a cycle either.
    ``__init__`` is the package itself (the container), not a layer member.
    """
    rows = []
    for layer in reversed(LAYERS):
        members = sorted(m for m, where in layers.items() if where == layer and m != "__init__")
        if members:
            rows.append(f'    "{" : ".join(members)}",  # {layer}')
    return "\n".join(
        [
            "[tool.importlinter]",
            'root_package = "diag"',
            "",
            "[[tool.importlinter.contracts]]",
            'name = "diag layers: foundations -> core -> analysis -> fix -> report -> cli (ARCHITECTURE.md)"',
            'type = "layers"',
            'containers = ["diag"]',
            "exhaustive = true",
            "# diag.fixtures and diag.reports_templates are mapped in from the root by the install (wheel or editable)",
            'exhaustive_ignores = ["fixtures", "reports_templates"]',
            "layers = [",
            *rows,
            "]",
            "",
            "[[tool.importlinter.contracts]]",
            'name = "no import cycle between diag modules"',
            'type = "acyclic_siblings"',
            'ancestors = ["diag"]',
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="project root (holds diag/ and ARCHITECTURE.md)")
    parser.add_argument("--edges", action="store_true", help="also list every import between diag modules")
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    parser.add_argument("--contract", action="store_true", help="print the import-linter contract of the table")
    parser.add_argument("--files", nargs="+", choices=LAYERS, metavar="LAYER", help="print the files of these layers")
    args = parser.parse_args(argv)
    facts = import_map(args.root)
    if args.files:
        print(" ".join(f"diag/{m}.py" for m in facts.modules if facts.layers.get(m) in args.files))
    elif args.contract:
        print(contract(facts.layers))
    elif args.json:
        json.dump(facts.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print("\n".join(summary(facts, args.edges)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
