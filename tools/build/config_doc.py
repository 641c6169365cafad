# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Generate docs/configuration.md from AFDConfig and the connectors' options.

    python tools/build/config_doc.py            # write the page
    python tools/build/config_doc.py --check    # exit 1 when the page is stale

Like vLLM's own config docs, the page is made from the attribute docstrings
that also become `--afd-config`'s help: every field of vllm/afd/adapter/config.py's
AFDConfig (name, type, default, docstring), then, per connector of the
registry (vllm/afd/transport/connectors/registry.py), the
connector_extra_config keys it reads (its class's `extra_config_keys` and the
docstring under it). The sources are read by AST, not imported: this runs
without the wheel, vLLM or torch installed.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = "vllm/afd/adapter/config.py"
REGISTRY = "vllm/afd/transport/connectors/registry.py"
PAGE = "docs/configuration.md"


@dataclass
class Field:
    name: str
    type: str
    default: str
    doc: str


def _parse(root: Path, rel: str) -> ast.Module:
    return ast.parse((root / rel).read_text(), filename=rel)


def _doc_after(body: list[ast.stmt], i: int, raw: bool = False) -> str | None:
    """The attribute docstring of body[i]: a string statement right after it
    (one line, or raw: as written, indentation removed)."""
    if i + 1 < len(body):
        nxt = body[i + 1]
        if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            text = nxt.value.value
            return inspect.cleandoc(text) if raw else " ".join(text.split())
    return None


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Module-level type aliases (AFDRole = Literal[...]) by name."""
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Subscript)):
            out[node.targets[0].id] = ast.unparse(node.value)
    return out


def _default(value: ast.expr | None) -> str:
    if value is None:
        return "(required)"
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id == "field"):
        for kw in value.keywords:
            if kw.arg == "default_factory":
                return {"list": "[]", "dict": "{}"}.get(ast.unparse(kw.value),
                                                        f"{ast.unparse(kw.value)}()")
            if kw.arg == "default":
                return ast.unparse(kw.value)
    return ast.unparse(value)


def afd_config_fields(root: Path = REPO) -> tuple[str, list[Field]]:
    """(AFDConfig's class docstring, its fields in declaration order)."""
    tree = _parse(root, CONFIG)
    aliases = _aliases(tree)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AFDConfig")
    fields = []
    for i, node in enumerate(cls.body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        type_ = ast.unparse(node.annotation)
        type_ = aliases.get(type_, type_)
        doc = _doc_after(cls.body, i)
        if doc is None:
            raise SystemExit(f"{CONFIG}: AFDConfig.{node.target.id} has no docstring "
                             f"(it is the field's --afd-config help)")
        fields.append(Field(node.target.id, type_, _default(node.value), doc))
    return " ".join((ast.get_docstring(cls) or "").split()), fields


def _module_path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _find_class(root: Path, rel: str, name: str) -> tuple[str, ast.ClassDef] | None:
    """The class `name` as seen from module rel: defined there or imported
    there from another vllm.afd module."""
    tree = _parse(root, rel)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return rel, node
    for node in tree.body:
        if (isinstance(node, ast.ImportFrom) and node.module
                and node.module.startswith("vllm.afd")
                and any((a.asname or a.name) == name for a in node.names)):
            orig = next(a.name for a in node.names if (a.asname or a.name) == name)
            return _find_class(root, _module_path(node.module), orig)
    return None


def _extra_keys(root: Path, rel: str, cls: ast.ClassDef) -> tuple[list[str], str] | None:
    """(sorted keys, docstring) of the first extra_config_keys along the bases
    (depth first, in base order: the method resolution order of ours)."""
    for i, node in enumerate(cls.body):
        if (isinstance(node, (ast.Assign, ast.AnnAssign))
                and "extra_config_keys" in ast.unparse(
                    node.targets[0] if isinstance(node, ast.Assign) else node.target)):
            keys = sorted(ast.literal_eval(c) for c in ast.walk(node.value)
                          if isinstance(c, ast.Constant) and isinstance(c.value, str))
            return keys, _doc_after(cls.body, i, raw=True) or ""
    for base in cls.bases:
        if isinstance(base, ast.Name):
            found = _find_class(root, rel, base.id)
            if found is not None:
                got = _extra_keys(root, *found)
                if got is not None:
                    return got
    return None


def connector_options(root: Path = REPO) -> list[tuple[str, dict[str, str]]]:
    """Per built-in connector: (name, {key: its doc}). The docstring under a
    connector's extra_config_keys has a paragraph per key, "key: meaning"; a
    paragraph that names no key (a connector without keys says why) is kept
    under "" ."""
    tree = _parse(root, REGISTRY)
    table = next(n.value for n in tree.body
                 if isinstance(n, (ast.Assign, ast.AnnAssign)) and "_CONNECTORS" in ast.unparse(
                     n.targets[0] if isinstance(n, ast.Assign) else n.target))
    out = []
    for name, target in ast.literal_eval(table).items():
        module, _, cls_name = target.partition(":")
        found = _find_class(root, _module_path(module), cls_name)
        if found is None:
            raise SystemExit(f"{REGISTRY}: {target} not found")
        keys, doc = _extra_keys(root, *found) or ([], "")
        docs: dict[str, str] = {}
        for para in filter(None, (p.strip() for p in doc.split("\n\n"))):
            m = re.match(r"(\w+): (.*)", para, re.S)
            key = m.group(1) if m and m.group(1) in keys else ""
            docs[key] = " ".join((m.group(2) if key else para).split())
        missing = [k for k in keys if k not in docs]
        if missing:
            raise SystemExit(f"{found[0]}: {cls_name}.extra_config_keys: no paragraph "
                             f"\"KEY: meaning\" in its docstring for {missing}")
        out.append((name, {k: docs.get(k, "") for k in keys} or {"": docs.get("", "No options.")}))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(root: Path = REPO) -> str:
    class_doc, fields = afd_config_fields(root)
    out = [
        "# Configuration reference",
        "",
        f"Generated by `python tools/build/config_doc.py` from `{CONFIG}` and the",
        "connectors' `extra_config_keys`; do not edit by hand (`make docs` regenerates it,",
        "`tests/test_docs.py` checks it). The same texts are `vllm serve --help`'s.",
        "",
        class_doc,
        "",
        "Set with `--afd-config '<JSON object>'` (each key a field below), `--afd-role`",
        "(the `role` field), `LLM(afd_config={...})`, or afd-plugin's",
        "`--additional-config '{\"afd\": {...}}'`. Unknown keys are refused, naming the",
        "valid ones.",
        "",
        "## `AFDConfig` fields",
        "",
        "| field | type | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for f in fields:
        out.append(f"| `{f.name}` | `{_cell(f.type)}` | `{_cell(f.default)}` | "
                   f"{_cell(f.doc)} |")
    out += [
        "",
        "## `connector_extra_config`, per connector",
        "",
        "Keys a connector does not read are refused at start-up, naming the ones it",
        "does. A connector registered under the `vllm_afd.connectors` entry-point group",
        "documents its own.",
        "",
        "| connector | key | meaning |",
        "| --- | --- | --- |",
    ]
    for name, keys in connector_options(root):
        for key, doc in keys.items():
            out.append(f"| `{name}` | {f'`{key}`' if key else '(none)'} | {_cell(doc)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=REPO)
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 when {PAGE} is not what this generates")
    args = ap.parse_args(argv)
    page = args.root / PAGE
    text = render(args.root)
    if args.check:
        if not page.exists() or page.read_text() != text:
            print(f"{PAGE} is out of date: run python tools/build/config_doc.py", file=sys.stderr)
            return 1
        print(f"{PAGE}: up to date")
        return 0
    page.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
