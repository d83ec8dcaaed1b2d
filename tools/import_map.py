"""Measure the imports between diag's modules: cycles, and imports that point up the layer table.

Usage (from anywhere; stdlib only, diag itself is never imported)::

    python tools/import_map.py              # summary, the cycles, the upward imports per module
    python tools/import_map.py --edges      # also every import between diag modules, with its line
    python tools/import_map.py --json       # the same facts as one JSON object
    python tools/import_map.py --contract   # the import-linter contract pyproject.toml must hold
    python tools/import_map.py --files foundations core   # the files of those layers (mypy --strict)

Each layer is a package, ``diag/<layer>/``, and a module is named by its file's stem
(``diag/core/streaming.py`` is ``streaming``; ``__init__`` and ``__main__`` are the top of
``diag/``). The layer of each module is also written in the module table of ``ARCHITECTURE.md`` (rows
``| `name` | layer | job |``); a module whose package is not its table's layer is *misplaced*.
Layers, lowest first: foundations, core, analysis, fix, report, cli. An import is *upward* when a
module imports one from a higher layer; imports within a layer are allowed (cycles are counted on
their own).

Each import of one diag module by another is classified by where it sits:

* ``top``: at module level (runs when the module is imported);
* ``lazy``: inside a function or method (runs when it is called);
* ``dynamic``: a string ``"diag.<module>"`` for ``importlib`` (the lazy table of ``diag/__init__.py``);
* ``typing``: under ``if TYPE_CHECKING:`` (never runs; listed, but not part of the graph).

``from diag import __version__`` (or ``import diag``) is an import of ``__init__``; imports of the
``diag.fixtures`` package (``fixtures/``) are outside diag's modules and not counted.

A *cycle* is a strongly connected component of more than one module in the graph of ``top`` and
``lazy`` imports: an import inside a function is a dependency all the same (the function cannot run
without the other module); it only hides the cycle from Python's import machinery. ``dynamic``
imports (a name of ``__init__``'s lazy table loads its module only when that name is read, and a
static import checker does not see them) and ``typing`` imports (they never run) are listed but
left out of the graph and of the upward count. ``cycle modules`` is how many modules the cycles
hold. The numbers are written in ARCHITECTURE.md; ``tests/test_architecture.py`` checks them against
this script.

NOTE: this measures, it does not enforce: ``lint-imports`` enforces the contract ``--contract``
prints (the six layer packages, highest first, and no cycle between the modules of one package).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("foundations", "core", "analysis", "fix", "report", "cli")
KINDS = ("top", "lazy", "dynamic", "typing")
_ROW = re.compile(r"^\|\s*`(?P<module>[A-Za-z_][A-Za-z0-9_]*)`\s*\|\s*(?P<layer>[a-z]+)\s*\|")
_DYNAMIC = re.compile(rf"diag\.(?:(?:{'|'.join(LAYERS)})\.)?(?P<module>[A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class Import:
    """One import of a diag module by another, where it sits, and the line it is on."""

    importer: str
    imported: str
    kind: str
    line: int
    #: Names imported that are private to the other module (``from diag.core.match import _value_dtypes``).
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

    #: Module -> its file, relative to diag/ (``core/streaming.py``).
    files: dict[str, str] = field(default_factory=dict)

    @property
    def misplaced(self) -> list[str]:
        """Modules whose file is not in their table layer's package (``__init__``, ``__main__``: top)."""
        return [m for m in self.modules if m in self.layers and self.files.get(m) != _home(m, self.layers[m])]

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
            "misplaced": self.misplaced,
            "files": self.files,
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


def _home(module: str, layer: str) -> str:
    """Where a module of a layer belongs, relative to diag/."""
    return f"{module}.py" if module in ("__init__", "__main__") else f"{layer}/{module}.py"


def module_files(package: Path) -> dict[str, Path]:
    """Module name -> file: ``package/*.py`` and ``package/<layer>/*.py`` (not the layers' ``__init__``)."""
    found = {p.stem: p for p in package.glob("*.py")}
    for layer in LAYERS:
        found.update({p.stem: p for p in (package / layer).glob("*.py") if p.name != "__init__.py"})
    return dict(sorted(found.items()))


def package_modules(package: Path) -> list[str]:
    """The module names of diag (``__init__`` and ``__main__`` included), sorted."""
    return list(module_files(package))


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


def _module_of(parts: list[str], modules: set[str]) -> str | None:
    """The diag module a dotted name (split, without ``diag``) is or lies in; None for a layer package."""
    if parts and parts[0] in LAYERS:
        parts = parts[1:]
        if not parts:
            return None
    if not parts:
        return "__init__"
    return parts[0] if parts[0] in modules else None


def _targets(node: ast.Import | ast.ImportFrom, modules: set[str], package: str = "diag") -> list[str]:
    """The diag modules one import statement loads (``from diag.foundations import files`` loads ``files``).

    ``package`` is the importer's package (``diag.core``), for relative imports.
    """
    if isinstance(node, ast.Import):
        found: list[str] = []
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == "diag":
                target = _module_of(parts[1:], modules)
                found += [target] if target else []
        return [m for m in found if m in modules]
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, *([node.module] if node.module else [])])
    else:
        base = node.module or ""
    parts = base.split(".")
    if parts[0] != "diag":
        return []
    inner = parts[1:]
    if inner and not (inner[0] in LAYERS and len(inner) == 1):  # "from diag.core.x import y"
        target = _module_of(inner, modules)  # diag.fixtures is not one of diag's modules
        return [target] if target else []
    # "from diag import x" (a module, or a name defined in diag/__init__.py), "from diag.core import x"
    if inner:
        return [alias.name for alias in node.names if alias.name in modules]
    return [alias.name if alias.name in modules else "__init__" for alias in node.names]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_imports(path: Path, modules: set[str]) -> list[Import]:
    """Every import of another diag module in one file, classified top / lazy / dynamic / typing."""
    importer = path.stem
    package = "diag" if path.parent.name not in LAYERS else f"diag.{path.parent.name}"
    found: list[Import] = []

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            private: tuple[str, ...] = ()
            if isinstance(node, ast.ImportFrom):
                private = tuple(a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__"))
            found.extend(
                Import(importer, t, kind, node.lineno, private)
                for t in _targets(node, modules, package)
                if t != importer
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
    """Measure diag's modules under ``root`` against the layer table of ``root/ARCHITECTURE.md``."""
    package = root / "diag"
    files = module_files(package)
    modules = list(files)
    layers = layer_table(root / "ARCHITECTURE.md")
    imports = [imp for name in modules for imp in module_imports(files[name], set(modules))]
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
    external = [f for name in modules for f in lazy_external(files[name])]
    where = {name: path.relative_to(package).as_posix() for name, path in files.items()}
    return ImportMap(modules, layers, imports, cycles, upward, layer_cycles, external, where)


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
    if facts.misplaced:
        lines.append(f"not in their layer's package: {', '.join(facts.misplaced)}")
    if edges:
        lines.append("imports:")
        lines += [f"  {i.importer}:{i.line} -> {i.imported} [{i.kind}]" for i in facts.imports]
    return lines


def contract() -> str:
    """The ``[tool.importlinter]`` section that enforces the layers, as pyproject.toml holds it.

    One ``layers`` contract over the six layer packages (highest first; ``__main__``, the one module
    left at the top besides the package's ``__init__``, sits with cli), exhaustive, so a new module
    or package at the top of diag must be placed in a layer, and one ``acyclic_siblings`` contract,
    so neither the layers nor the modules of one layer form a cycle (it checks the children of
    every package under diag).
    """
    rows = ['    "__main__ : cli",'] + [f'    "{layer}",' for layer in reversed(LAYERS) if layer != "cli"]
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
        print(" ".join(f"diag/{facts.files[m]}" for m in facts.modules if facts.layers.get(m) in args.files))
    elif args.contract:
        print(contract())
    elif args.json:
        json.dump(facts.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print("\n".join(summary(facts, args.edges)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
