"""Nothing in ``torchheal/`` may unpickle (or ``eval``) data that could come from the network.

The guard reads every module with ``ast`` (nothing is imported) and resolves names through
each module's imports, so ``from pickle import loads as l; l(x)`` is caught as well as
``pickle.loads(x)``. It flags:

* ``pickle``/``_pickle``/``cPickle``/``dill``/``cloudpickle``/``joblib`` loading (``load``,
  ``loads``, ``Unpickler``), ``marshal.load(s)``, ``shelve.open``, ``jsonpickle.decode``,
  ``pandas.read_pickle``; any reference to them, not only calls;
* ``torch.load`` without ``weights_only=True``, ``numpy.load`` with ``allow_pickle=True``;
* ``yaml.load``/``load_all`` without a safe ``Loader``, and ``yaml``'s unsafe/full loaders;
* ``eval`` and ``exec``;
* torch.distributed's object collectives (``broadcast_object_list``, ``all_gather_object``,
  ``gather_object``, ``scatter_object_list``, ``recv_object_list``): they unpickle what peers
  send;
* ``multiprocessing`` connections and queues: ``Listener``/``Client`` (pickled messages over
  TCP), a queue's creation (its ``get()`` unpickles), and any ``.recv(...)`` call without
  positional arguments (``Connection.recv()`` unpickles; a socket's or a process group's
  ``recv`` takes arguments).

A few places unpickle data that never leaves the host: the Baby process groups' parent and
child exchange pickled messages over their own ``multiprocessing`` pipes. Those are listed in
:data:`ALLOWED`, each with its reason; an entry that no longer matches anything fails too, so
the list cannot rot.
"""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torchheal"

UNPICKLERS = (
    {
        f"{module}.{name}"
        for module in ("pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib")
        for name in ("load", "loads", "Unpickler")
    }
    | {
        "marshal.load",
        "marshal.loads",
        "shelve.open",
        "jsonpickle.decode",
        "pandas.read_pickle",
        "eval",
        "exec",
        "builtins.eval",
        "builtins.exec",
        "yaml.unsafe_load",
        "yaml.unsafe_load_all",
        "yaml.full_load",
        "yaml.full_load_all",
        "multiprocessing.connection.Listener",
        "multiprocessing.connection.Client",
    }
    | {
        f"{module}.{name}"
        for module in ("torch.distributed", "torch.distributed.distributed_c10d")
        for name in (
            "broadcast_object_list",
            "all_gather_object",
            "gather_object",
            "scatter_object_list",
            "recv_object_list",
        )
    }
)
QUEUES = {
    f"{module}.{name}"
    for module in ("multiprocessing", "torch.multiprocessing")
    for name in ("Queue", "SimpleQueue", "JoinableQueue", "Manager")
}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}

# (file, function, what) -> why it is safe. Only data that never leaves this host.
ALLOWED: dict[tuple[str, str, str], str] = {
    (
        "torchheal/multiprocessing.py",
        "_MonitoredPipe.recv",
        "Connection.recv()",
    ): "the monitored pipe of a Baby process group: parent and child on this host only",
    (
        "torchheal/process_group/baby.py",
        "ProcessGroupBaby.configure",
        "Connection.recv()",
    ): "the parent reads its own child's start-up answer over their local pipe",
    (
        "torchheal/process_group/baby.py",
        "ProcessGroupBaby._request",
        "Connection.recv()",
    ): "the parent reads its own child's answers over their local pipe",
    (
        "torchheal/process_group/baby.py",
        "ProcessGroupBaby._future_handler",
        "Connection.recv()",
    ): "the parent reads its own child's finished futures over their local pipe",
    (
        "torchheal/process_group/baby_child.py",
        "_Child.loop",
        "Connection.recv()",
    ): "the child reads its parent's requests over their local pipe",
}


@dataclass(frozen=True)
class Finding:
    """One place that unpickles, evaluates or may receive pickles.

    Args:
        file: path relative to the repository root.
        function: the enclosing function's qualified name ("<module>" at top level).
        line: line number.
        what: what was found.
    """

    file: str
    function: str
    line: int
    what: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.file, self.function, self.what)


class _Scanner(ast.NodeVisitor):
    def __init__(self, file: str) -> None:
        self.file = file
        self.aliases: dict[str, str] = {}  # local name -> dotted name it stands for
        self.scope: list[str] = []
        self.findings: list[Finding] = []

    def _add(self, node: ast.AST, what: str) -> None:
        function = ".".join(self.scope) or "<module>"
        self.findings.append(Finding(self.file, function, node.lineno, what))  # type: ignore[attr-defined]

    # Imports: remember what each local name refers to (also inside functions).
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                self.aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            dotted = f"{node.module}.{alias.name}" if node.module else alias.name
            self.aliases[alias.asname or alias.name] = dotted
            self._check_name(node, dotted)

    def _scoped(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, node.name)

    def resolve(self, node: ast.AST) -> str | None:
        """The dotted name an expression refers to, through the module's imports."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def _check_name(self, node: ast.AST, dotted: str | None) -> None:
        if dotted in UNPICKLERS:
            self._add(node, dotted)
        elif dotted in QUEUES:
            self._add(node, f"{dotted} (its get() unpickles)")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check_name(node, self.resolve(node))
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in ("eval", "exec") and node.id not in self.aliases:
            self._add(node, node.id)
        elif node.id in self.aliases and node.id != self.aliases[node.id]:
            self._check_name(node, self.aliases[node.id])

    def visit_Call(self, node: ast.Call) -> None:
        dotted = self.resolve(node.func)
        keywords = {k.arg: k.value for k in node.keywords}
        if dotted in ("torch.load", "torch.serialization.load"):
            weights_only = keywords.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                self._add(node, "torch.load without weights_only=True")
        elif dotted == "numpy.load":
            allow = keywords.get("allow_pickle")
            if not (allow is None or (isinstance(allow, ast.Constant) and allow.value is False)):
                self._add(node, "numpy.load with allow_pickle")
        elif dotted in ("yaml.load", "yaml.load_all"):
            loader = keywords.get("Loader") or (node.args[1] if len(node.args) > 1 else None)
            name = self.resolve(loader) if loader is not None else None
            if name is None or name.rsplit(".", 1)[-1] not in SAFE_YAML_LOADERS:
                self._add(node, f"{dotted} without a safe Loader")
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "recv" and not node.args:
            self._add(node, "Connection.recv()")
        self.generic_visit(node)


def find_unpickling(package: Path, root: Path) -> list[Finding]:
    """Every finding in the ``.py`` files under ``package`` (paths relative to ``root``)."""
    findings: list[Finding] = []
    for path in sorted(package.rglob("*.py")):
        if "node_modules" in path.parts:
            continue
        scanner = _Scanner(path.relative_to(root).as_posix())
        scanner.visit(ast.parse(path.read_text(), filename=str(path)))
        findings += scanner.findings
    return findings


def test_nothing_in_torchheal_unpickles_network_data() -> None:
    findings = find_unpickling(PACKAGE, ROOT)
    unexplained = [f for f in findings if f.key not in ALLOWED]
    assert not unexplained, "unpickling or eval outside the allowlist:\n" + "\n".join(
        f"  {f.file}:{f.line} in {f.function}: {f.what}" for f in unexplained
    )
    stale = set(ALLOWED) - {f.key for f in findings}
    assert not stale, f"allowlist entries that match nothing any more: {sorted(stale)}"


SNIPPETS = {
    "import pickle\npickle.loads(b)": "pickle.loads",
    "from pickle import loads as l\nl(b)": "pickle.loads",
    "import pickle as p\nclass U(p.Unpickler): pass": "pickle.Unpickler",
    "import _pickle\n_pickle.load(f)": "_pickle.load",
    "import dill\ndill.loads(b)": "dill.loads",
    "import marshal\nmarshal.loads(b)": "marshal.loads",
    "import shelve\nshelve.open('x')": "shelve.open",
    "import torch\ntorch.load(f)": "torch.load without weights_only=True",
    "import torch\ntorch.load(f, weights_only=False)": "torch.load without weights_only=True",
    "from torch import load\nload(f)": "torch.load without weights_only=True",
    "import numpy as np\nnp.load(f, allow_pickle=True)": "numpy.load with allow_pickle",
    "import yaml\nyaml.load(s)": "yaml.load without a safe Loader",
    "import yaml\nyaml.load(s, Loader=yaml.Loader)": "yaml.load without a safe Loader",
    "import yaml\nyaml.unsafe_load(s)": "yaml.unsafe_load",
    "eval(text)": "eval",
    "exec(text)": "exec",
    "import torch.distributed as dist\ndist.all_gather_object(out, x)": (
        "torch.distributed.all_gather_object"
    ),
    "from torch.distributed import recv_object_list\nrecv_object_list(x, 0)": (
        "torch.distributed.recv_object_list"
    ),
    "import multiprocessing as mp\nq = mp.Queue()": "multiprocessing.Queue (its get() unpickles)",
    "from multiprocessing.connection import Listener": "multiprocessing.connection.Listener",
    "conn.recv()": "Connection.recv()",
    "conn.recv(timeout=5)": "Connection.recv()",
}
HARMLESS = [
    "import pickle\npickle.dumps(x)",
    "import torch\ntorch.load(f, weights_only=True)",
    "import numpy as np\nnp.load(f)",
    "import yaml\nyaml.load(s, Loader=yaml.SafeLoader)",
    "import yaml\nyaml.safe_load(s)",
    "import json\njson.loads(s)",
    "sock.recv(4096)",
    "pg.recv([t], 0, 1)",
    "import asyncio\nq = asyncio.Queue()",
    "ast.literal_eval(s)",
]


def _scan(source: str) -> list[str]:
    scanner = _Scanner("snippet.py")
    scanner.visit(ast.parse(source))
    return [f.what for f in scanner.findings]


def test_the_guard_sees_each_forbidden_pattern() -> None:
    for source, what in SNIPPETS.items():
        assert what in _scan(source), (source, _scan(source))
    for source in HARMLESS:
        assert _scan(source) == [], (source, _scan(source))


def test_the_guard_fails_on_a_copy_of_torchheal_that_unpickles(tmp_path: Path) -> None:
    # A scratch copy of the package with one forbidden call added where network bytes arrive.
    copy = tmp_path / "torchheal"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("node_modules", "__pycache__"))
    target = copy / "checkpointing" / "http_transport.py"
    target.write_text(
        target.read_text()
        + "\n\ndef _load_legacy(resp):\n    import pickle\n\n    return pickle.loads(resp.read())\n"
    )
    assert find_unpickling(PACKAGE, ROOT) != find_unpickling(copy, tmp_path)
    new = [f for f in find_unpickling(copy, tmp_path) if f.key not in ALLOWED]
    assert [(f.file, f.function, f.what) for f in new] == [
        ("torchheal/checkpointing/http_transport.py", "_load_legacy", "pickle.loads")
    ]
