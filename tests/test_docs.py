# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The docs say what the code is, and only that.

- docs/configuration.md is what tools/build/config_doc.py generates from AFDConfig's
  field docstrings and the connectors' extra_config_keys (as vLLM generates its
  config docs), it lists every field and key the installed code has, and it
  goes stale when a docstring changes;
- no doc, docstring or comment names a vllm.afd module or a vllm/afd/ file
  that does not exist;
- the seams have one inventory, docs/patches.md, generated from the series, and
  tools/build/check_series.py holds seams.py's exports to what the patches call.
(That README and docs/ carry no dates is tests/test_readme.py's.)
"""

import ast
import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest

import check_series
import config_doc

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / config_doc.PAGE


def page_rows(section: str) -> list[list[str]]:
    """The table rows (cells) under a '## ' heading of the configuration page."""
    text = PAGE.read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split(" | ")]
            for line in body.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")][1:]


# ------------------------------------------------------------ configuration page
def test_the_configuration_page_is_generated_from_the_code(capsys):
    assert config_doc.main(["--check"]) == 0, capsys.readouterr().err


def test_every_field_and_connector_key_is_on_the_page():
    """Against the installed code, not only the sources the generator reads: a
    field or key the generator missed fails here."""
    from vllm.afd.adapter.config import AFDConfig
    from vllm.afd.transport.connectors.registry import connector_class, connector_names

    rows = {r[0].strip("`"): r for r in page_rows("`AFDConfig` fields")}
    for f in fields(AFDConfig):
        assert f.name in rows, f"AFDConfig.{f.name} is not on {config_doc.PAGE}"
    assert list(rows) == [f.name for f in fields(AFDConfig)]
    keys: dict[str, set[str]] = {}
    for r in page_rows("`connector_extra_config`, per connector"):
        keys.setdefault(r[0].strip("`"), set()).add(r[1].strip("`"))
    for name in ("shm", "tcp", "loopback", "nccl"):
        assert name in connector_names()
        documented = keys[name] - {"(none)"}
        assert documented == set(connector_class(name).extra_config_keys), name


def copy_sources(tmp_path: Path) -> Path:
    """A scratch root with what the generator reads, and the page."""
    root = tmp_path / "root"
    shutil.copytree(REPO / "vllm" / "afd", root / "vllm" / "afd",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (root / "docs").mkdir()
    shutil.copy(PAGE, root / config_doc.PAGE)
    return root


def test_a_changed_docstring_makes_the_page_stale(tmp_path, capsys):
    """The check can fail: a field's docstring edited (as a reviewer would see
    it in --help), then a connector key's, each makes --check exit 1 until the
    page is regenerated."""
    root = copy_sources(tmp_path)
    assert config_doc.main(["--root", str(root), "--check"]) == 0
    edits = [
        ("vllm/afd/adapter/config.py", '"""Port of the FFN server\'s rendezvous socket (1-65535)."""',
         '"""Port of the FFN server\'s rendezvous socket (1-65535, see above)."""'),
        ("vllm/afd/transport/connectors/tcp.py", '    """spin_us: microseconds (0-1000000, '
         'default 0)', '    """spin_us: microseconds (0 to 1000000, default 0)'),
    ]
    for rel, old, new in edits:
        path = root / rel
        assert old in path.read_text(), (rel, old)
        path.write_text(path.read_text().replace(old, new))
        assert config_doc.main(["--root", str(root), "--check"]) == 1
        assert "out of date" in capsys.readouterr().err
        assert config_doc.main(["--root", str(root)]) == 0
        assert config_doc.main(["--root", str(root), "--check"]) == 0
    assert "(1-65535, see above)" in (root / config_doc.PAGE).read_text()


def test_a_field_or_key_without_a_docstring_is_refused(tmp_path):
    root = copy_sources(tmp_path)
    config = root / "vllm/afd/adapter/config.py"
    text = config.read_text()
    config.write_text(text.replace('    """Port of the FFN server\'s rendezvous socket '
                                   '(1-65535)."""\n', "", 1))
    with pytest.raises(SystemExit, match="AFDConfig.port has no docstring"):
        config_doc.render(root)
    config.write_text(text)
    shm = root / "vllm/afd/transport/connectors/shm.py"
    shm.write_text(shm.read_text().replace(
        'frozenset({"notify", "spin_us", "stream_copies"})',
        'frozenset({"notify", "spin_us", "stream_copies", "ring_entries"})'))
    with pytest.raises(SystemExit, match=r"no paragraph .* for \['ring_entries'\]"):
        config_doc.render(root)


def test_the_generator_needs_no_vllm(tmp_path):
    """It reads the sources: it runs where nothing is installed (a docs build)."""
    proc = subprocess.run(["python3", "-S", "-c", "import sys; sys.path.insert(0, 'tools/build'); "
                           "import config_doc; print(len(config_doc.render()))"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and int(proc.stdout) > 1000, proc.stderr


# ------------------------------------------------------------ names that exist
MODULE = re.compile(r"\bvllm\.afd(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
PATH = re.compile(r"\bvllm/afd/[A-Za-z0-9_/]+\.py\b")


def _top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
                if isinstance(t, ast.Name) and t.id == "__all__":
                    names.update(ast.literal_eval(node.value))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def names_something(dotted: str) -> bool:
    """Whether vllm.afd.a.b... is a package, module, or a top-level name of one
    (a function, class, constant or import; deeper attributes are not checked)."""
    parts = dotted.split(".")[2:]
    base = REPO / "vllm" / "afd"
    for i, part in enumerate(parts):
        if part.startswith("__") and part.endswith("__"):
            return True  # __file__, __version__, ...
        if (base / part).is_dir():
            base = base / part  # a package, or a data directory (planner/profiles)
            continue
        if (base / f"{part}.py").is_file():
            rest = parts[i + 1:]
            return not rest or rest[0] in _top_level_names(base / f"{part}.py")
        if part == "_C" and base == REPO / "vllm" / "afd":
            return "vllm/afd/_C" in (REPO / "setup.py").read_text()  # built by setup.py
        init = base / "__init__.py"
        return init.is_file() and part in _top_level_names(init)
    return True


def texts_to_check() -> dict[str, str]:
    """Every doc, docstring and comment of ours that can name vllm/afd code:
    docs, READMEs and notes, our Python, the Dockerfiles, the Makefile, and the
    patches' DEP-3 headers (their bodies are upstream code; changing one
    changes the series digest and so the built wheel)."""
    files = [*REPO.glob("docs/*.md"), REPO / "README.md", *REPO.glob("benchmarks/*.md"),
             *REPO.glob("vllm/afd/**/*.py"), *REPO.glob("tools/**/*.py"),
             *REPO.glob("tests/**/*.py"), *REPO.glob("benchmarks/*.py"),
             *REPO.glob("Dockerfile*"), REPO / "Makefile"]
    texts = {str(f.relative_to(REPO)): f.read_text() for f in files
             if f.is_file() and f != Path(__file__)}
    for patch in (REPO / "patches").rglob("*.patch"):
        text = patch.read_text()
        texts[str(patch.relative_to(REPO))] = text[:text.find("\n--- a/")]
    return texts


def stale_names(texts: dict[str, str]) -> list[str]:
    found = []
    for name, text in texts.items():
        for n, line in enumerate(text.splitlines(), 1):
            found += [f"{name}:{n}: {m.group(0)}" for m in MODULE.finditer(line)
                      if not names_something(m.group(0))]
            found += [f"{name}:{n}: {m.group(0)}" for m in PATH.finditer(line)
                      if not (REPO / m.group(0)).is_file()]
    return found


def test_no_doc_names_a_vllm_afd_module_that_does_not_exist():
    assert stale_names(texts_to_check()) == []


@pytest.mark.parametrize("line", [
    "the link's state (vllm.afd.link_status)", "families (vllm.afd.metrics)",
    "statistics (vllm.afd.stats)", "the FFN server (vllm/afd/server.py)",
    "`vllm.afd.api.install`", "vllm.afd.seams.no_such_seam", "vllm/afd/attention/gone.py",
])
def test_a_stale_name_is_found(line):
    """The names this check was written for, and a missing attribute and file."""
    assert stale_names({"doc.md": line}) != []


@pytest.mark.parametrize("line", [
    "vllm.afd.attention.status", "vllm.afd.observability.metrics",
    "vllm.afd.seams.distribution_version()", "vllm.afd.adapter.config.AFDConfig.",
    "vllm.afd.__version__", "vllm.afd._C", "vllm/afd/adapter/ffn/http.py",
])
def test_a_current_name_passes(line):
    assert stale_names({"doc.md": line}) == []


# --------------------------------------------------------------- the seams
def test_the_seams_have_one_inventory():
    """docs/patches.md lists each patch's seams (check_series keeps it fresh);
    seams.py's docstring points there instead of keeping its own table, and
    the architecture page links it."""
    assert check_series.seam_problems(REPO) == []
    doc = (REPO / "docs" / "patches.md").read_text()
    assert doc == check_series.render_docs(REPO)
    exported = ast.literal_eval(next(
        n.value for n in ast.parse((REPO / "vllm/afd/seams.py").read_text()).body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__"))
    for seam in exported:
        assert f"`{seam}`" in doc, seam
    seams_doc = ast.get_docstring(ast.parse((REPO / "vllm/afd/seams.py").read_text()))
    assert "docs/patches.md" in seams_doc and "where (upstream)" not in seams_doc
    assert "(patches.md)" in (REPO / "docs" / "architecture.md").read_text()


def test_a_seam_no_patch_calls_is_found(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(REPO / "patches", root / "patches")
    (root / "vllm" / "afd").mkdir(parents=True)
    seams = (REPO / "vllm/afd/seams.py").read_text()
    (root / "vllm/afd/seams.py").write_text(seams.replace('__all__ = [\n',
                                                          '__all__ = [\n    "unused_seam",\n'))
    assert check_series.seam_problems(root) == [
        "vllm.afd.seams.unused_seam is exported but no patch calls it"]
    (root / "vllm/afd/seams.py").write_text(re.sub(r'"begin_mlp",\s*', "", seams, count=1))
    problems = check_series.seam_problems(root)
    assert len(problems) == 1 and "call(s) vllm.afd.seams.begin_mlp" in problems[0]

