"""The layering of ``torchheal/`` holds: read from the source with ``ast``, nothing imported.

The layer order is the ``layers`` block of ``docs/architecture.md`` (lowest first), so the page
and the code cannot drift apart: a module may import from its own layer and the layers below,
never from one above; the module graph has no cycle; every module belongs to a layer; the pure
cores import nothing that does I/O; the programs of ``coordination/`` stay apart; and only
``_base/env.py`` reads the environment.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "torchheal"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# What a pure core may import: plain data and typing, nothing that touches time, threads,
# sockets, processes or torch.
PURE_ALLOWED = {"__future__", "dataclasses", "enum", "typing", "collections", "math", "itertools"}

# The three programs of coordination/: each shares only the cores below it, never the modules of
# another (a client that imported the lighthouse would drag a server into every rank).
PROGRAMS = (
    "torchheal.coordination.clients",
    "torchheal.coordination.group",
    "torchheal.coordination.lighthouse",
)
# Edges between programs that are allowed, and why.
PROGRAM_EDGES_ALLOWED = {
    (
        "torchheal.coordination.lighthouse.dashboard",
        "torchheal.coordination.clients",
    ): "the dashboard's stop button asks a group's manager server to exit",
}

# Modules allowed to touch os.environ, and why.
ENVIRON_ALLOWED = {
    "torchheal._base.env": "the one place that reads the environment",
    "torchheal.launcher.local": "passes its own environment on to the processes it starts",
    "torchheal.launcher.spare_child": "a warm spare becoming a rank takes on its environment",
}


def read_layers(text: str) -> list[tuple[str, list[str]]]:
    """``[(layer name, [module prefixes])]`` from the page's ``layers`` block, lowest first."""
    match = re.search(r"```layers\n(.*?)```", text, re.S)
    if match is None:
        raise AssertionError("docs/architecture.md has no ```layers block")
    layers = []
    for line in match.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, modules = line.partition(":")
        layers.append((name.strip(), modules.split()))
    return layers


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The modules ``name`` imports (any depth of the file, lazy ones too) -> first line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.append(sub if sub in modules else source)
        for target in targets:
            if target.split(".")[0] == "torchheal" and target != name:
                found.setdefault(target, node.lineno)
    return found


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """Imports under ``if TYPE_CHECKING:`` (never run, so they cannot do I/O)."""
    skipped: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            for child in node.body:
                skipped |= set(ast.walk(child))
    return skipped


def stdlib_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    type_only = _type_checking_only(tree)
    tops: set[str] = set()
    for node in ast.walk(tree):
        if node in type_only:
            continue
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            tops.add((node.module or "").split(".")[0])
    return tops - {"torchheal"}


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """Index of the layer whose longest prefix matches ``module``."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


LAYERS = read_layers(ARCHITECTURE.read_text())
MODULES = module_files()
GRAPH = {name: imports_of(name, path, MODULES) for name, path in MODULES.items()}


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in MODULES if layer_of(m, LAYERS) is None)
    assert not missing, f"modules in no layer of docs/architecture.md: {missing}"


def test_the_page_names_only_modules_that_exist() -> None:
    stale = [p for _, prefixes in LAYERS for p in prefixes if p not in MODULES]
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"


def test_no_module_imports_a_higher_layer() -> None:
    upward = []
    for module, targets in GRAPH.items():
        own = layer_of(module, LAYERS)
        for target, line in targets.items():
            theirs = layer_of(target, LAYERS)
            if own is not None and theirs is not None and theirs > own:
                upward.append(
                    f"{MODULES[module].relative_to(ROOT)}:{line} ({LAYERS[own][0]}) imports "
                    f"{target} ({LAYERS[theirs][0]})"
                )
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    # Tarjan's strongly connected components; any component of two or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH.get(node, {}):
            if nxt not in GRAPH:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("module", [m for _, mods in LAYERS[:1] for m in mods] or ["-"])
def test_lowest_layer_imports_nothing_of_torchheal(module: str) -> None:
    inside = [m for m in MODULES if m == module or m.startswith(module + ".")]
    for name in inside:
        outside = [t for t in GRAPH[name] if not t.startswith(module)]
        assert not outside, f"{name} (lowest layer) imports {outside}"


def test_pure_cores_do_no_io() -> None:
    pure = [prefixes for name, prefixes in LAYERS if name == "pure"]
    assert pure, "docs/architecture.md has no 'pure' layer"
    for module in pure[0]:
        extra = stdlib_imports(MODULES[module]) - PURE_ALLOWED
        assert not extra, f"{module} is a pure core but imports {sorted(extra)}"
        for target in GRAPH[module]:
            assert target in pure[0], f"{module} is pure but imports {target}"


def _program_of(module: str) -> str | None:
    return next((p for p in PROGRAMS if module == p or module.startswith(p + ".")), None)


def test_programs_import_none_of_each_other() -> None:
    crossing = []
    for module, targets in GRAPH.items():
        own = _program_of(module)
        if own is None:
            continue
        for target, line in targets.items():
            theirs = _program_of(target)
            if theirs is None or theirs == own:
                continue
            if any(
                (module == m or module.startswith(m + ".")) and theirs == allowed
                for m, allowed in PROGRAM_EDGES_ALLOWED
            ):
                continue
            crossing.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}")
    assert not crossing, "one program of coordination/ imports another:\n" + "\n".join(crossing)


def test_only_the_env_module_touches_the_environment() -> None:
    offenders = []
    for name, path in MODULES.items():
        if name in ENVIRON_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
                if isinstance(node.value, ast.Name) and node.value.id == "os":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} os.{node.attr}")
    assert not offenders, "environment access outside torchheal/_base/env.py:\n" + "\n".join(
        offenders
    )
