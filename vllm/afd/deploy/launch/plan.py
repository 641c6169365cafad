# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""From a checked spec and the cluster's nodes to the plan: which server runs on
which node and bundle, its ports, ranks, `--afd-config` and command line.

Pure: nothing here talks to Ray, so `--dry-run` prints exactly what a launch
would start, and tests check plans without a cluster.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from vllm.afd.deploy.launch.spec import DeploymentSpec, SpecError

# A bundle asks for this much of its node's `node:<ip>` resource: it pins the
# server's placement group to the node the plan chose.
NODE_PIN = 0.001


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    resources: dict[str, float]


@dataclass
class ServerPlan:
    name: str  # attention-0, ffn-1, ...
    role: str
    node: Node
    bundle: dict[str, float]  # its placement group's one bundle, pinned to node
    http_port: int
    ranks: list[int]  # attention ranks or FFN ranks
    afd_config: dict = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # never the secret
    shm_globs: list[str] = field(default_factory=list)  # /dev/shm names of its links

    @property
    def endpoint(self) -> str:
        host = f"[{self.node.ip}]" if ":" in self.node.ip else self.node.ip
        return f"http://{host}:{self.http_port}"


def _bundle(spec: DeploymentSpec, role: str) -> dict[str, float]:
    r = getattr(spec, role)
    if role == "ffn" and spec.ffn.executor == "ray":
        # vLLM's Ray executor places the workers itself (its own placement
        # group); this server's bundle holds its API server and engine core.
        return {"CPU": 1.0}
    return {k: v * r.ranks_per_server for k, v in r.resources.items()}


def _fits(free: dict[str, float], need: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) >= v for k, v in need.items())


def _place(spec: DeploymentSpec, nodes: list[Node]) -> list[tuple[str, int, Node, dict]]:
    if not nodes:
        raise SpecError("no alive node in the Ray cluster")
    free = {n.node_id: dict(n.resources) for n in nodes}
    # FFN servers first: they are the larger bundles on GPU clusters.
    order = [("ffn", i) for i in range(spec.ffn.servers)] + \
            [("attention", i) for i in range(spec.attention.servers)]
    placed = []
    for k, (role, i) in enumerate(order):
        need = _bundle(spec, role)
        if spec.placement == "spread":
            candidates = nodes[k % len(nodes):] + nodes[:k % len(nodes)]
        else:
            candidates = nodes
        if spec.connector == "shm" and placed:
            candidates = [placed[0][2]]  # one node for every server
        node = next((n for n in candidates if _fits(free[n.node_id], need)), None)
        if node is None:
            have = "; ".join(f"{n.ip}: {_fmt(free[n.node_id])}" for n in candidates)
            raise SpecError(f"{role}.resources: {role}-{i} needs {_fmt(need)} on one node, "
                            f"and no node has it left (free: {have})")
        for key, v in need.items():
            free[node.node_id][key] -= v
        placed.append((role, i, node, {**need, f"node:{node.ip}": NODE_PIN}))
    return placed


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())
                           if not k.startswith("node:") and k not in (
                               "memory", "object_store_memory")) + "}"


def make_plan(spec: DeploymentSpec, nodes: list[Node], vllm: str = "vllm") -> list[ServerPlan]:
    """Servers in start order (FFN servers first), each with its node and command."""
    placed = _place(spec, nodes)
    node_of = {(role, i): node for role, i, node, _ in placed}
    tp = spec.ffn.tensor_parallel_size
    ffn_hosts = [node_of[("ffn", f // tp)].ip for f in range(spec.num_ffn_ranks)]
    link: dict = {"connector": spec.connector, "port": spec.afd_port,
                  "num_attention_ranks": spec.num_attention_ranks,
                  "num_ffn_ranks": spec.num_ffn_ranks, "num_ubatches": spec.num_ubatches}
    if spec.connector == "shm":
        link["host"] = "127.0.0.1"  # a local socket: one node, no network
    elif len(set(ffn_hosts)) == 1:
        link["host"] = ffn_hosts[0]
    else:
        link["ffn_hosts"] = ffn_hosts
    if spec.allow_insecure:
        link["allow_insecure"] = True
    plans = []
    for role, i, node, bundle in placed:
        r = getattr(spec, role)
        width = r.ranks_per_server
        ranks = list(range(i * width, (i + 1) * width))
        afd = {**spec.afd_config, **link, "role": role,
               f"{role}_rank": ranks[0]}
        http_port = r.http_port + i
        argv = [vllm, "serve", spec.model, "--host", "0.0.0.0", "--port", str(http_port),
                "--afd-role", role, "--afd-config", json.dumps(afd, sort_keys=True)]
        if role == "ffn":
            if width > 1:
                argv += ["--tensor-parallel-size", str(width)]
            if spec.ffn.expert_parallel:
                argv.append("--enable-expert-parallel")
            if spec.ffn.executor == "ray":
                argv += ["--distributed-executor-backend", "ray"]
        elif width > 1:
            argv += ["--data-parallel-size", str(width)]
        argv += [*spec.args, *r.args]
        # shm segments are named after the FFN rank's link port
        # (transport/connectors/shm.py); one node holds them all.
        shm = ([f"vllm-afd-{spec.afd_port + f}-*" for f in range(spec.num_ffn_ranks)]
               if spec.connector == "shm" else [])
        plans.append(ServerPlan(name=f"{role}-{i}", role=role, node=node,
                                bundle=bundle, http_port=http_port, ranks=ranks,
                                afd_config=afd, argv=argv, env={**spec.env, **r.env},
                                shm_globs=shm))
    return plans


def describe(spec: DeploymentSpec, plans: list[ServerPlan]) -> str:
    """The plan as a table and each command line (no secret: it travels through
    Ray to a file each server reads, never on a command line)."""
    rows = [("server", "node", "bundle", "http", "link ports", "ranks")]
    for p in plans:
        if p.role == "ffn":
            link_ports = ",".join(str(spec.afd_port + f) for f in p.ranks)
            ranks = "ffn " + ",".join(map(str, p.ranks))
        else:
            link_ports = "-"
            ranks = "attention " + ",".join(map(str, p.ranks))
        rows.append((p.name, p.node.ip, _fmt(p.bundle), str(p.http_port), link_ports, ranks))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [f"deployment {spec.name!r}: {spec.attention.servers} attention server(s), "
             f"{spec.ffn.servers} FFN server(s), connector {spec.connector}, "
             f"{spec.num_ubatches} micro-batch(es), secret: "
             f"{_secret_source(spec)}"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
              for row in rows]
    for p in plans:
        env = " ".join(f"{k}={v}" for k, v in sorted(p.env.items()))
        lines.append(f"  {p.name}: {env + ' ' if env else ''}{' '.join(_quote(a) for a in p.argv)}")
    return "\n".join(lines)


def _secret_source(spec: DeploymentSpec) -> str:
    if spec.secret is None:
        return "none (allow_insecure)" if spec.needs_secret else "none (one node, shm)"
    source = f"${spec.secret.env}" if spec.secret.env is not None else spec.secret.file
    return f"from {source}, through Ray to each server's token_file"


def _quote(arg: str) -> str:
    return f"'{arg}'" if any(c in arg for c in " {}\"$") else arg
