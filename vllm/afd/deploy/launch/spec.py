# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The deployment spec of `vllm-afd launch`: a YAML or JSON file naming the model,
the attention and FFN servers and how they are linked.

Everything is checked before anything starts; an error names the field
(`attention.servers`, `secret.env`, `ffn.args`, ...). README "Many machines"
shows a whole spec; every field's docstring below says what it means.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vllm.afd.transport.wire import MAX_UBATCHES

# --afd-config keys the launcher sets itself (from the spec's structure).
OWNED_AFD_KEYS = {"role", "connector", "host", "ffn_hosts", "port", "num_attention_ranks",
                  "num_ffn_ranks", "attention_rank", "ffn_rank", "num_ubatches",
                  "token_file", "allow_insecure"}
# vllm serve flags the launcher sets itself.
OWNED_FLAGS = {"--host", "--port", "--afd-role", "--afd-config", "--tensor-parallel-size",
               "-tp", "--data-parallel-size", "-dp", "--enable-expert-parallel",
               "--distributed-executor-backend", "--data-parallel-backend",
               "--pipeline-parallel-size", "-pp"}


class SpecError(ValueError):
    """A deployment spec that cannot be launched; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Secret(_Strict):
    """Where the shared AFD secret comes from, on the machine running the launcher;
    the launcher hands it to each server through Ray, never on a command line,
    in a log or in the printed plan."""

    env: str | None = None
    """Name of an environment variable holding it (e.g. VLLM_AFD_TOKEN)."""
    file: str | None = None
    """Path of a file holding it (surrounding whitespace ignored)."""

    @model_validator(mode="after")
    def _one_source(self) -> Secret:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of 'env' and 'file'")
        return self

    def read(self) -> str:
        if self.env is not None:
            value = os.environ.get(self.env, "").strip()
            if not value:
                raise SpecError(f"secret.env: {self.env} is not set (or empty) in the "
                                f"launcher's environment")
            return value
        try:
            value = Path(self.file).read_text().strip()
        except OSError as e:
            raise SpecError(f"secret.file: cannot read {self.file}: {e.strerror}") from e
        if not value:
            raise SpecError(f"secret.file: {self.file} is empty")
        return value


class RoleSpec(_Strict):
    servers: int = 1
    """How many servers of this role."""
    http_port: int
    """HTTP port of the first server; server i serves http_port + i."""
    resources: dict[str, float] = Field(default_factory=lambda: {"GPU": 1})
    """Ray resources per rank (a data-parallel rank or a tensor-parallel worker);
    {"CPU": 1} on CPU-only clusters."""
    args: list[str] = Field(default_factory=list)
    """More `vllm serve` arguments for this role's servers."""
    env: dict[str, str] = Field(default_factory=dict)
    """More environment variables for this role's servers."""

    @property
    def ranks_per_server(self) -> int:
        return 1


class AttentionSpec(RoleSpec):
    data_parallel_size: int = 1
    """Data-parallel ranks per attention server (each is an attention rank)."""

    @property
    def ranks_per_server(self) -> int:
        return self.data_parallel_size


class FFNSpec(RoleSpec):
    tensor_parallel_size: int = 1
    """Workers per FFN server (each is an FFN rank)."""
    expert_parallel: bool = False
    """Shard the experts over the workers (--enable-expert-parallel) instead of
    tensor-parallel slices of every expert."""
    executor: Literal["mp", "ray"] = "mp"
    """vLLM's executor for the workers (--distributed-executor-backend): 'mp'
    (processes beside the server), or 'ray' (Ray actors vLLM places itself)."""

    @property
    def ranks_per_server(self) -> int:
        return self.tensor_parallel_size


class DeploymentSpec(_Strict):
    model: str
    """The model: a path present on every node, or a hub name every node can load."""
    name: str = "afd"
    """Deployment name: Ray placement groups and actors are named after it, so the
    same deployment cannot be launched twice on one cluster."""
    attention: AttentionSpec
    ffn: FFNSpec
    connector: Literal["shm", "tcp", "nccl"] = "tcp"
    """The link: 'tcp' (any nodes), 'shm' (all servers on one node), 'nccl'."""
    afd_port: int = 7700
    """FFN rank f listens on afd_port + f on its node."""
    num_ubatches: int = 1
    """Micro-batches per step (1-4), for every server."""
    placement: Literal["pack", "spread"] = "pack"
    """'pack': fill one node before the next; 'spread': servers round-robin over
    the nodes. A server's ranks always share one node."""
    secret: Secret | None = None
    """Where the shared secret comes from; required unless connector is shm."""
    allow_insecure: bool = False
    """Run a network link without a secret (trusted, isolated networks only)."""
    afd_config: dict[str, Any] = Field(default_factory=dict)
    """More --afd-config keys for every server (timeout_s, transfer_dtype, gate_on,
    connector_extra_config)."""
    args: list[str] = Field(default_factory=list)
    """More `vllm serve` arguments for every server."""
    env: dict[str, str] = Field(default_factory=dict)
    """More environment variables for every server."""

    @property
    def num_attention_ranks(self) -> int:
        return self.attention.servers * self.attention.data_parallel_size

    @property
    def num_ffn_ranks(self) -> int:
        return self.ffn.servers * self.ffn.tensor_parallel_size

    @property
    def needs_secret(self) -> bool:
        """Whether the link crosses the network (shm stays on one node, on a
        local socket, unless its notify option is tcp)."""
        extra = self.afd_config.get("connector_extra_config", {}) or {}
        return self.connector != "shm" or extra.get("notify") == "tcp"


def _where(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def parse(data: Any, source: str = "spec") -> DeploymentSpec:
    """A checked DeploymentSpec from a decoded YAML/JSON document."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping at the top level, got "
                        f"{type(data).__name__}")
    try:
        spec = DeploymentSpec.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            where = _where(err["loc"]) or "spec"
            if err["type"] == "extra_forbidden":
                problems.append(f"{where}: unknown key")
            elif err["type"] == "missing":
                problems.append(f"{where}: required")
            else:
                problems.append(f"{where}: {err['msg']}")
        raise SpecError(f"{source}: " + "; ".join(problems)) from None
    check(spec)
    return spec


def load(path: str | Path) -> DeploymentSpec:
    """Read and check a spec file (YAML, of which JSON is a subset)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"{path}: cannot read the spec: {e.strerror}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML or JSON: {e}") from e
    if isinstance(data, dict) and isinstance(data.get("model"), str) and \
            os.path.exists(data["model"]):
        # A local path is taken from where the launcher runs (the servers'
        # working directory is Ray's): the same absolute path on every node.
        data["model"] = os.path.abspath(data["model"])
    return parse(data, str(path))


def check(spec: DeploymentSpec) -> None:
    """What the field types cannot say, each problem naming its field."""
    for role in ("attention", "ffn"):
        r = getattr(spec, role)
        if r.servers < 1:
            raise SpecError(f"{role}.servers: must be >= 1, got {r.servers}")
        if r.ranks_per_server < 1:
            field = "data_parallel_size" if role == "attention" else "tensor_parallel_size"
            raise SpecError(f"{role}.{field}: must be >= 1, got {r.ranks_per_server}")
        for name, amount in r.resources.items():
            if amount <= 0:
                raise SpecError(f"{role}.resources.{name}: must be > 0, got {amount}")
        owned = sorted({a.split("=", 1)[0] for a in r.args} & OWNED_FLAGS)
        if owned:
            raise SpecError(f"{role}.args: {', '.join(owned)} is set by the launcher from "
                            f"the spec; remove it")
    owned = sorted({a.split("=", 1)[0] for a in spec.args} & OWNED_FLAGS)
    if owned:
        raise SpecError(f"args: {', '.join(owned)} is set by the launcher from the spec; "
                        f"remove it")
    owned = sorted(set(spec.afd_config) & OWNED_AFD_KEYS)
    if owned:
        raise SpecError(f"afd_config.{owned[0]}: set by the launcher from the spec "
                        f"(connector, afd_port, num_ubatches, secret, the servers); remove it")
    if not 1 <= spec.num_ubatches <= MAX_UBATCHES:
        raise SpecError(f"num_ubatches: {spec.num_ubatches} is not in 1-{MAX_UBATCHES}")
    if spec.connector == "shm" and spec.placement == "spread":
        raise SpecError("placement: 'spread' puts servers on several nodes, but connector "
                        "'shm' needs them all on one; use connector 'tcp'")
    if spec.needs_secret and spec.secret is None and not spec.allow_insecure:
        raise SpecError(f"secret: connector '{spec.connector}' links servers over the "
                        f"network; give secret: {{env: VLLM_AFD_TOKEN}} or {{file: PATH}} "
                        f"(or allow_insecure: true on a trusted, isolated network)")
    if spec.secret is not None:
        spec.secret.read()  # present and readable now, not at the first server
    _check_ports(spec)


def _check_ports(spec: DeploymentSpec) -> None:
    """Every port of the deployment distinct (nodes are chosen later: a clash
    would depend on where Ray puts the servers) and in range."""
    taken: dict[int, str] = {}

    def claim(port: int, what: str, field: str) -> None:
        if not 1 <= port <= 65535:
            raise SpecError(f"{field}: port {port} ({what}) is not in 1-65535")
        if port in taken:
            raise SpecError(f"{field}: port {port} ({what}) is also {taken[port]}")
        taken[port] = what

    for role in ("attention", "ffn"):
        r = getattr(spec, role)
        for i in range(r.servers):
            claim(r.http_port + i, f"{role}-{i}'s HTTP port", f"{role}.http_port")
    for f in range(spec.num_ffn_ranks):
        claim(spec.afd_port + f, f"FFN rank {f}'s link port", "afd_port")

