# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""vllm/afd's modules import one another without a cycle, and none of them
imports vllm.afd.seams (the patches' one entry point calls into AFD, never the
other way).

Every import counts, at module level or inside a function: a lazy import
hides a cycle from Python's import machinery, not from a reader, and the next
move of a symbol turns it into an ImportError. Read from the source (AST), so
the rule holds for the tree in git, whatever is installed."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file, for every module of package (a folder under root,
    e.g. "vllm/afd"), named as imported with root on sys.path."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        names[name.removesuffix(".__init__")] = path
    return names


def imports_in(source: str, package: str) -> set[str]:
    """Every dotted name `source` (a module of `package`) imports, at module
    level or in a function: `from package import name` gives package and
    package.name (so `from vllm import logger` is vllm.logger); relative
    imports resolved against package."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.update([base, *(f"{base}.{alias.name}" for alias in node.names)])
    return found


def imports_of(name: str, path: Path) -> set[str]:
    """imports_in for module `name`, read from its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imports_in(path.read_text(), package)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of `modules` it imports (a package's __init__ for
    `from package import name`, and the submodule when name is one)."""
    return {name: {t for t in imports_of(name, path) if t in modules and t != name}
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_vllm_afd_has_no_import_cycle():
    graph = import_graph(module_names(ROOT, "vllm/afd"))
    assert len(graph) > 50 and "vllm.afd.transport.connectors.tcp" in graph
    assert cycles(graph) == []


def test_nothing_in_vllm_afd_imports_the_seams():
    graph = import_graph(module_names(ROOT, "vllm/afd"))
    assert sorted(m for m, deps in graph.items() if "vllm.afd.seams" in deps) == []


# The halves of docs/architecture.md as folders: the engine adapter (everything
# that imports vLLM), the deployment tools, and the rest, the data plane.
APART = ("vllm.afd.adapter", "vllm.afd.deploy", "vllm.afd.seams")


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def outside_the_data_plane(target: str) -> bool:
    """Whether an import of `target` leaves the data plane: vLLM (vllm.afd
    aside), the adapter, the deployment tools or the seams."""
    return ((target == "vllm" or target.startswith("vllm."))
            and (not within(target, ("vllm.afd",)) or within(target, APART)))


def test_the_data_plane_imports_nothing_from_vllm_the_adapter_or_the_tools():
    """Outside adapter/, deploy/ and seams.py nothing imports vLLM (vllm.afd
    aside), the adapter or the deployment tools: the data plane stands alone
    (a transport can be tested, benchmarked and run without vLLM), and it logs
    through logging.getLogger (its records still reach vLLM's handlers, under
    the `vllm` logger), never vllm.logger."""
    modules = module_names(ROOT, "vllm/afd")
    data_plane = {n: p for n, p in modules.items() if not within(n, APART)}
    assert "vllm.afd.attention.link" in data_plane and "vllm.afd.ffn.loop" in data_plane
    found = sorted(f"{name} imports {target}" for name, path in data_plane.items()
                   for target in imports_of(name, path) if outside_the_data_plane(target))
    assert found == []


def test_the_import_rule_sees_every_form_of_importing_vllm():
    package = "vllm.afd.attention"
    for source in ("from vllm import logger", "import vllm", "from vllm.logger import x",
                   "def f():\n    import vllm.envs", "from ...logger import init_logger",
                   "from vllm import envs as e", "from vllm.afd.adapter import config",
                   "from ..deploy.planner import cost"):
        assert any(map(outside_the_data_plane, imports_in(source, package))), source
    for source in ("from vllm.afd.transport import base", "from ..transport import base",
                   "import logging", "from . import pingpong"):
        assert not any(map(outside_the_data_plane, imports_in(source, package))), source


def test_a_cycle_through_a_lazy_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("import pkg.a\ndef g(): pass\n")
    (pkg / "d.py").write_text("from . import a\n")  # imports into the cycle, not part of it
    graph = import_graph(module_names(tmp_path, "pkg"))
    assert graph["pkg.d"] == {"pkg", "pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
