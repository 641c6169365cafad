# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The README's deployment examples are consistent as written: the same
checks the servers run at start-up and in the handshake, applied to its
lines (tests/afd/test_topology.py runs the same topologies for real)."""

import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from vllm.afd.config import AFDConfig
from vllm.afd.topology import ffn_placement

README = Path(__file__).resolve().parent.parent / "README.md"


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
    setup = text[text.index("## Set-up: two commands"):]
    setup = setup[setup.index("```") + 3:]
    setup = setup[:setup.index("```")]
    commands = re.findall(r"^(make \w+)", setup, re.M)
    assert commands == ["make demo", "make test"]
    assert "exec make test" in (README.parent / ".ci" / "run").read_text()


LAUNCH_SPECS = sorted((README.parent / "docs" / "launch").glob("*.yaml"))


def test_launch_specs_parse_and_plan(tmp_path, monkeypatch):
    """The README's and docs/launch's deployment specs are valid, the README's are
    the files' text, and each plans onto two GPU nodes (or one CPU node)."""
    from vllm.afd.launch import spec as spec_file
    from vllm.afd.launch.plan import Node, make_plan

    text = README.read_text()
    section = text[text.index("## Many machines"):text.index("## Docker")]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(blocks) == 2
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
