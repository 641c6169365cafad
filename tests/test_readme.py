# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The README's deployment examples are consistent as written: the same
checks the servers run at start-up and in the handshake, applied to its
lines (tests/afd/ffn/test_topology.py runs the same topologies for real). And the
README stays a page a user can act on: short, the set-up commands first, every
relative link in it, in docs/ and in benchmarks/README.md resolving to a file
and a heading, `make help` naming every target."""

import json
import re
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from vllm.afd.adapter.config import AFDConfig
from vllm.afd.topology import ffn_placement

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# The pages whose relative links must resolve.
PAGES = [README, REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def deployments() -> list[list[list[str]]]:
    """The `vllm serve` lines of the README's Topologies block, as argv lists,
    grouped by blank lines: a shell prompt (`$ `), environment assignments
    before the command and continued lines (`\\`) are read as a shell would; any
    other line, or no command at all, is an error (at collection: the run fails)."""
    text = README.read_text()
    block = text[text.index("### Topologies"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    groups, current = [], []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        argv = shlex.split(line, comments=True)
        while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):
            argv.pop(0)  # VAR=value before the command
        if not line:
            if current:
                groups.append(current)
            current = []
        elif argv[:2] == ["vllm", "serve"]:
            current.append(argv)
        elif argv:
            raise ValueError(f"README Topologies block: not a `vllm serve` line: {line!r}")
    if current:
        groups.append(current)
    if not groups:
        raise ValueError("README Topologies block: no `vllm serve` lines found")
    return groups


def option(argv: list[str], name: str, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


@pytest.mark.parametrize("servers", deployments(), ids=lambda g: f"{len(g)}-servers")
def test_topology_examples_are_consistent(servers):
    configs = []
    for argv in servers:
        afd = AFDConfig(**json.loads(option(argv, "--afd-config", "{}")),
                        role=option(argv, "--afd-role"))
        tp = int(option(argv, "--tensor-parallel-size", 1))
        configs.append((afd, tp, int(option(argv, "--port", 8000))))
    # Each server its own HTTP port on one host.
    ports = [port for _, _, port in configs]
    assert len(set(ports)) == len(ports), ports
    ffns = [(a, tp) for a, tp, _ in configs if a.is_ffn]
    attentions = [a for a, _, _ in configs if a.is_attention]
    assert ffns and attentions
    for a, _, _ in configs:  # the handshake compares these
        for key in ("num_attention_ranks", "num_ffn_ranks", "connector", "gate_on"):
            assert getattr(a, key) == getattr(configs[0][0], key), key
    ffn_ranks = []
    for ffn, tp in ffns:
        parallel = SimpleNamespace(world_size=tp, pipeline_parallel_size=1,
                                   data_parallel_size=1, data_parallel_rank=0)
        ffn_ranks += [ffn_placement(SimpleNamespace(afd_config=ffn, parallel_config=parallel),
                                    w).rank for w in range(tp)]
        # The FFN serves any peer whose micro-batch count is at most its own.
        assert all(a.num_ubatches <= ffn.num_ubatches for a in attentions)
    assert sorted(ffn_ranks) == list(range(ffns[0][0].num_ffn_ranks))
    assert sorted(a.attention_rank for a in attentions) == list(
        range(attentions[0].num_attention_ranks))


def test_two_setup_commands():
    text = README.read_text()
    setup = text[text.index("## Try it: two commands"):]
    setup = setup[setup.index("```") + 3:]
    setup = setup[:setup.index("```")]
    commands = re.findall(r"^(make \w+)", setup, re.M)
    assert commands == ["make demo", "make test"]
    assert "exec make test" in (README.parent / ".ci" / "run").read_text()
    # Within the first screen of the page, not after the reference material.
    head = "\n".join(text.splitlines()[:40])
    assert re.search(r"^make demo\b", head, re.M) and re.search(r"^make test\b", head, re.M), (
        "README: `make demo` and `make test` must appear within its first 40 lines")


def test_readme_is_short_and_undated():
    """A page a user reads in five minutes: reference material lives in docs/,
    measurements in benchmarks/ (dated there, never in the README or docs/)."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300)"
    dated = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\bthat (morning|afternoon|evening|night)\b")
    assert dated.search("It ran on an H200 on 2026-12-04 (torch 2.11).")
    assert not dated.search("protocol version 8, hidden 7168, 2048 x 2048")
    offenders = [f"{page.relative_to(REPO)}:{n}: {line.strip()[:80]}"
                 for page in [README, *sorted((REPO / "docs").rglob("*.md"))]
                 for n, line in enumerate(page.read_text().splitlines(), 1)
                 # docs/patches.md is generated: each patch's `Last update` is a field.
                 if dated.search(line) and not line.startswith("- Last update: ")]
    assert offenders == [], offenders


LAUNCH_SPECS = sorted((README.parent / "docs" / "launch").glob("*.yaml"))


def test_launch_specs_parse_and_plan(tmp_path, monkeypatch):
    """The README's and docs/launch's deployment specs are valid, the ones shown
    (README, docs/launch/README.md) are the files' text, and each plans onto two
    GPU nodes (or one CPU node)."""
    from vllm.afd.deploy.launch import spec as spec_file
    from vllm.afd.deploy.launch.plan import Node, make_plan

    text = README.read_text()
    section = text[text.index("### Many machines"):]
    section = section[:re.search(r"^##", section[3:], re.M).start() + 3]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(blocks) >= 1
    blocks += re.findall(r"```yaml\n(.*?)```",
                         (README.parent / "docs" / "launch" / "README.md").read_text(), re.S)
    files = {p.name: p.read_text() for p in LAUNCH_SPECS}
    for block in blocks:
        assert any(block in body for body in files.values()), block[:200]
    monkeypatch.setenv("VLLM_AFD_TOKEN", "t" * 32)
    token = tmp_path / "token"
    token.write_text("f" * 32)
    gpus = [Node(f"n{i}", f"10.0.0.{i}", {"CPU": 32.0, "GPU": 8.0}) for i in (1, 2)]
    cpus = [Node("n1", "127.0.0.1", {"CPU": 4.0})]
    planned = {}
    for path in LAUNCH_SPECS:
        data = yaml.safe_load(path.read_text())
        if "file" in (data.get("secret") or {}):
            data["secret"]["file"] = str(token)
        spec = spec_file.parse(data, path.name)
        nodes = cpus if "CPU" in spec.ffn.resources else gpus
        planned[path.name] = {p.name: p for p in make_plan(spec, nodes)}
    assert sorted(planned["2a1f.yaml"]) == ["attention-0", "attention-1", "ffn-0"]
    assert [p.node.ip for p in planned["2a1f.yaml"].values()] == [
        "10.0.0.1", "10.0.0.2", "10.0.0.1"]  # spread
    ep = planned["1a2f-ep.yaml"]["ffn-0"]
    assert ep.ranks == [0, 1] and "--enable-expert-parallel" in ep.argv
    assert ep.argv[ep.argv.index("--distributed-executor-backend") + 1] == "ray"


def test_every_afd_config_shown_is_valid(monkeypatch):
    """Each `--afd-config '{...}'` in the README and docs/ is a config the
    servers accept (placeholders such as `{"port": ...}` aside)."""
    monkeypatch.setenv("VLLM_AFD_TOKEN", "t" * 32)  # the README's two-host `export`
    shown = []
    for page in [README, *sorted((REPO / "docs").rglob("*.md"))]:
        for line in page.read_text().replace("\\\n", " ").splitlines():
            for config in re.findall(r"--afd-config '(\{.*?\})'", line):
                if "..." not in config:
                    role = re.search(r"--afd-role (\w+)", line)
                    shown.append((page.name, config, role.group(1) if role else None))
    assert len(shown) >= 8, shown
    for name, config, role in shown:
        values = json.loads(config)
        try:
            AFDConfig(**values, **({"role": role} if role and "role" not in values else {}))
        except ValueError as e:
            raise AssertionError(f"{name}: --afd-config '{config}': {e}") from None


# ----------------------------------------------------------------- the links
def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped except
    `-` and `_`, each space a `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def strip_code(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = github_slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def link_problems(page: Path, root: Path = REPO) -> list[str]:
    """Every relative markdown link of the page, and every `path.md#anchor`
    named in its text (code included: commands and docstrings cite them), that
    does not lead to an existing file and heading. Paths are tried relative to
    the page, then to the repository root."""
    def name(p: Path) -> str:
        return str(p.relative_to(root)) if p.is_relative_to(root) else p.name

    text = page.read_text()
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", strip_code(text))
    targets += re.findall(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md#[\w-]+)", text)
    problems = []
    for target in dict.fromkeys(targets):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        candidates = [page.parent / path, root / path] if path else [page]
        found = next((c for c in candidates if c.exists()), None)
        if found is None:
            problems.append(f"{name(page)}: {target}: no such file")
        elif anchor and (found.is_dir() or anchor not in anchors(found)):
            problems.append(f"{name(page)}: {target}: no heading #{anchor} in {name(found)}")
    return problems


def test_github_slugs():
    assert github_slug("Many machines: `vllm-afd launch` on Ray") == (
        "many-machines-vllm-afd-launch-on-ray")
    assert github_slug("One host, shared memory (the default)") == (
        "one-host-shared-memory-the-default")
    assert github_slug("`make plan-check`: the planner against `make bench`") == (
        "make-plan-check-the-planner-against-make-bench")
    assert github_slug("Status and metrics") == "status-and-metrics"


@pytest.mark.parametrize("page", [*PAGES, REPO / "tools" / "serving" / "demo.py"],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    assert link_problems(page) == []


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[gone](nowhere.md), [here](#title), [bad](#nothing), "
                    "[there](other.md#a-section), see other.md#no-such-section.\n"
                    "```\n[in code](not-checked.md)\n```\n")
    assert sorted(link_problems(page, root=tmp_path)) == [
        "page.md: #nothing: no heading #nothing in page.md",
        "page.md: nowhere.md: no such file",
        "page.md: other.md#no-such-section: no heading #no-such-section in other.md"]


# ---------------------------------------------------------------- make help
def phony_targets() -> list[str]:
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    return [t for line in re.findall(r"^\.PHONY:(.*)$", text, re.M) for t in line.split()]


def test_make_help_lists_every_target():
    phony = phony_targets()
    assert "help" in phony and "demo" in phony and len(phony) > 20
    out = subprocess.run(["make", "-s", "--no-print-directory", "help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    listed = re.findall(r"^  ([\w-]+) ", out, re.M)
    assert sorted(listed) == sorted(phony), (
        f"missing from `make help`: {sorted(set(phony) - set(listed))}; "
        f"listed but not .PHONY: {sorted(set(listed) - set(phony))}")
    # `make` alone still runs the demo.
    dry = subprocess.run(["make", "-n", "--no-print-directory"], cwd=REPO,
                         capture_output=True, text=True, timeout=120).stdout
    assert "tools/serving/demo.py" in dry
