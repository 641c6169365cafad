# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""AFDConfig: the role of this server and how it reaches its attention/FFN peers.

How to add a field: give it a default and an attribute docstring (it becomes the
`--afd-config` help text), validate it in __post_init__ naming the valid choices,
and add it to compile_factors() only if it changes the computation graph.
"""

import json
import sys
from dataclasses import field, fields
from typing import Any, Literal

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from vllm.afd.transport.config import LinkRoles, check_link_fields, parse_endpoint
from vllm.utils.hashing import safe_hash

AFDRole = Literal["attention", "ffn"]
AFDGatePlacement = Literal["ffn", "attention"]
AFDUbatchPolicy = Literal["auto", "fixed"]

# Keys of afd-plugin's `--additional-config '{"afd": {...}}'` and their aliases,
# mapped onto our fields so its users' recipes work unchanged.
_PLUGIN_KEYS = {
    "connector": "connector",
    "afd_connector": "connector",
    "role": "role",
    "afd_role": "role",
    "host": "host",
    "afd_host": "host",
    "port": "port",
    "afd_port": "port",
    "num_attention_ranks": "num_attention_ranks",
    "num_ffn_ranks": "num_ffn_ranks",
    "compute_gate_on_attention": "gate_on",
    "connector_extra_config": "connector_extra_config",
}
# afd-plugin's connector names for the transports we implement.
_PLUGIN_CONNECTORS = {"P2pNcclAFDConnector": "nccl", "p2pconnector": "nccl",
                      "dummy": "loopback"}


# NOTE: this is what vllm.config.utils.config does (a pydantic dataclass that
# forbids unknown fields), spelled out because VllmConfig imports this module:
# importing vllm.config.utils from here would import vllm.config first, a cycle.
@dataclass(config=ConfigDict(extra="forbid"))
class AFDConfig(LinkRoles):
    """Attention-FFN Disaggregation (AFD): the attention role serves the API and runs
    attention; every decoder layer's MLP/MoE runs on the FFN role."""

    role: AFDRole = "attention"
    """This server's role: 'attention' (API, scheduler, KV cache, attention layers)
    or 'ffn' (runs each layer's MLP/MoE for its attention peers)."""

    connector: str = "shm"
    """Transport between the roles: 'shm' (same host, shared memory), 'tcp' (across
    hosts), 'loopback' (in-process, tests), 'nccl' (CUDA point-to-point), 'ipc' (same
    host, layer calls through each other's device memory; CUDA never run yet), or any
    connector registered under the `vllm_afd.connectors` entry-point group."""

    host: str = "127.0.0.1"
    """Address the FFN server listens on and attention servers connect to."""

    ffn_hosts: list[str] = field(default_factory=list)
    """Per FFN rank, the address it listens on and attention servers connect to
    (num_ffn_ranks entries, rank order), for FFN servers on several hosts; empty:
    every FFN rank uses host."""

    port: int = 7700
    """Port of the FFN server's rendezvous socket (1-65535)."""

    ffn_pool: list[str] = field(default_factory=list)
    """Attention role: FFN deployments that can serve the same FFN ranks, as
    "host:port" (each one's `port`; its FFN rank f listens on port + f). Each step
    goes to the next ready one (round robin over steps); when one fails mid-step,
    the step's unfinished layer calls go again to another and the step completes.
    Empty: the one deployment at host (ffn_hosts) and port."""

    ffn_pool_file: str | None = None
    """Attention role: a file listing more ffn_pool members, one "host:port" per
    line ('#' starts a comment), re-read every second: members added are used
    without a restart, members removed are closed once no step uses them."""

    num_attention_ranks: int = 1
    """Total number of attention worker ranks feeding the FFN servers."""

    num_ffn_ranks: int = 1
    """Total number of FFN worker ranks. FFN rank f listens on port + f; attention
    rank a is served by FFN rank a % num_ffn_ranks and, when that rank is part of
    a tensor/expert-parallel FFN server, by all of that server's ranks."""

    attention_rank: int = 0
    """This attention server's first rank; its data-parallel ranks take
    attention_rank, attention_rank + 1, ... (independent attention servers set
    0, 1, 2, ...)."""

    ffn_rank: int = 0
    """This FFN server's first rank; its workers (tensor/expert parallel) take
    ffn_rank, ffn_rank + 1, ... (independent FFN servers set 0, 1, 2, ...)."""

    num_ubatches: int = 1
    """Micro-batches per step, pipelined so attention overlaps the FFN round trip
    (1 to 4); with ubatch_policy 'auto' the most a step may use."""

    ubatch_policy: AFDUbatchPolicy = "auto"
    """Attention role, num_ubatches > 1: how many micro-batches a step runs.
    'auto' (default): per step size, the count measured fastest, from 1 to
    num_ubatches (each is timed on a few steps, again every 200 steps), so a
    split that costs more than its overlap gains is not run; 'fixed': always
    min(num_ubatches, tokens)."""

    gate_on: AFDGatePlacement = "ffn"
    """Where the MoE router runs: 'ffn' (default) or 'attention' (top-k ids and
    weights travel with the hidden states)."""

    transfer_dtype: str | dict[str, str] = "auto"
    """How hidden states cross the link: 'auto' (the model's dtype, exact) or 'fp8'
    (float8 e4m3 with one float32 scale per 128 elements of a token: about half the
    bytes of bf16; docs/fp8.md gives its format, its error and what is tested). One
    value for both directions, or per direction: {"to_ffn": "fp8", "to_attention":
    "auto"}. Both roles must be given the same."""

    timeout_s: float = 60.0
    """Seconds to wait for a peer (connection, step, layer result) before failing
    with an error."""

    connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """Transport-specific options, passed to the connector, which refuses keys it
    does not read (each connector's keys: docs/configuration.md)."""

    token_file: str | None = None
    """File holding the secret shared by the attention and FFN servers (surrounding
    whitespace ignored); the alternative to the VLLM_AFD_TOKEN environment variable
    (set one of the two, on both roles). Peers prove they know it by challenge-response;
    it is never sent."""

    allow_insecure: bool = False
    """Let an FFN server listen on a non-loopback host without a secret, serving any
    peer that reaches its port. Only for trusted, isolated networks."""

    def __post_init__(self) -> None:
        # role and gate_on are Literal fields: pydantic rejects other values
        # with the field name and the valid choices.
        from vllm.afd.transport.connectors.registry import connector_names

        if self.connector not in connector_names():
            raise ValueError(f"AFDConfig.connector: unknown connector {self.connector!r}; "
                             f"valid names: {', '.join(connector_names())}")
        if not self.host:
            raise ValueError("AFDConfig.host: must not be empty")
        self.transfer_dtype = _transfer_dtypes(self.transfer_dtype)
        check_link_fields(self, "AFDConfig")  # what LinkConfig checks too
        self._check_pool()
        for name, total in (("attention_rank", "num_attention_ranks"),
                            ("ffn_rank", "num_ffn_ranks")):
            if not 0 <= getattr(self, name) < getattr(self, total):
                raise ValueError(f"AFDConfig.{name}: {getattr(self, name)} is not in 0-"
                                 f"{getattr(self, total) - 1} ({total} = "
                                 f"{getattr(self, total)})")
        self._check_security()

    def _check_pool(self) -> None:
        if not (self.ffn_pool or self.ffn_pool_file is not None):
            return
        if self.is_ffn:
            raise ValueError("AFDConfig.ffn_pool / ffn_pool_file: only the attention role "
                             "has a pool (an FFN server listens on its own host and port)")
        if self.ffn_hosts:
            raise ValueError("AFDConfig.ffn_pool: each pool member serves all its FFN ranks "
                             "from one host; ffn_hosts cannot be combined with it")
        if self.ffn_pool_file is not None and not self.ffn_pool_file.strip():
            raise ValueError("AFDConfig.ffn_pool_file: must not be empty (omit it for no "
                             "file)")
        seen = set()
        for endpoint in self.ffn_pool:
            host, port = parse_endpoint(endpoint, "AFDConfig.ffn_pool")
            if port + self.num_ffn_ranks - 1 > 65535:
                raise ValueError(f"AFDConfig.ffn_pool: {endpoint!r}: its FFN ranks would "
                                 f"listen on ports {port}-{port + self.num_ffn_ranks - 1}")
            if (host, port) in seen:
                raise ValueError(f"AFDConfig.ffn_pool: {endpoint!r} is listed twice")
            seen.add((host, port))

    def _check_security(self) -> None:
        # Imported here: this module is imported while vllm.config loads.
        from vllm.afd.transport import auth

        if self.token_file is not None and not self.token_file.strip():
            raise ValueError("AFDConfig.token_file: must not be empty (omit it for no "
                             "secret)")
        if self.token_file and auth.secret_configured(None):
            raise ValueError(f"AFDConfig.token_file: the AFD secret is set twice, by "
                             f"{auth.TOKEN_ENV} and by token_file ({self.token_file}); use "
                             f"exactly one of them")
        if self.is_ffn and self.listens_on_tcp:
            where = "ffn_hosts" if self.ffn_hosts else "host"
            for host in set(self.ffn_hosts) or {self.host}:
                auth.check_listen_address(
                    host, has_secret=auth.secret_configured(self.token_file),
                    allow_insecure=self.allow_insecure,
                    what=f"AFDConfig.{where}: the FFN server")

    @property
    def listens_on_tcp(self) -> bool:
        """Whether the FFN side of this connector listens on host:port over TCP
        (shm only with connector_extra_config {"notify": "tcp"}; its default is a
        local abstract unix socket)."""
        if self.connector == "shm":
            return (self.connector_extra_config.get("notify", "unix") == "tcp"
                    or not sys.platform.startswith("linux"))
        return self.connector != "loopback"

    @property
    def transfer_to_ffn(self) -> str:
        """How hidden states travel to the FFN ('auto' or 'fp8')."""
        return self.transfer_dtype["to_ffn"]  # normalized by __post_init__

    @property
    def transfer_to_attention(self) -> str:
        """How the FFN's outputs travel back ('auto' or 'fp8')."""
        return self.transfer_dtype["to_attention"]

    def link_config(self):
        """What the data plane needs of this config (transport/config.py)."""
        from vllm.afd.transport.config import LinkConfig

        return LinkConfig.of(self)

    def compile_factors(self) -> dict[str, object]:
        """What changes the computation graph: the role decides which layers a
        server builds, micro-batches and gate placement reshape the attention
        side's forward. Addresses, transports and timeouts do not. (vLLM 0.34's
        VllmConfig.compile_factors takes it as is.)"""
        return {"role": self.role, "num_ubatches": self.num_ubatches,
                "gate_on": self.gate_on}

    def compute_hash(self) -> str:
        """Hash of compile_factors (vLLM 0.32's VllmConfig.compute_hash)."""
        factors = list(self.compile_factors().values())
        return safe_hash(str(factors).encode(), usedforsecurity=False).hexdigest()

    @classmethod
    def from_cli(cls, afd_config: "AFDConfig | dict | str | None",
                 afd_role: str | None = None,
                 additional_config: dict | None = None) -> "AFDConfig | None":
        """Build from `--afd-config` (JSON or dict), `--afd-role` and afd-plugin's
        `--additional-config '{"afd": {...}}'`; None when AFD is off."""
        values: dict[str, Any] = {}
        plugin = (additional_config or {}).get("afd") if isinstance(
            additional_config, dict) else None
        if plugin is not None:
            values.update(_from_plugin_keys(plugin))
        if isinstance(afd_config, AFDConfig):
            values.update({f.name: getattr(afd_config, f.name) for f in fields(cls)})
        elif isinstance(afd_config, str):
            try:
                parsed = json.loads(afd_config)
            except json.JSONDecodeError as e:
                raise ValueError(f"--afd-config: not valid JSON ({e}): {afd_config!r}") from e
            values.update(_checked_keys(parsed, "--afd-config"))
        elif isinstance(afd_config, dict):
            values.update(_checked_keys(afd_config, "--afd-config"))
        elif afd_config is not None:
            raise ValueError(f"--afd-config: expected JSON object, got {type(afd_config)}")
        if afd_role is not None:
            values["role"] = afd_role
        if not values:
            return None
        config = cls(**values)
        if config.is_attention:
            # Before the engine processes start: they inherit where to publish
            # the link's state for this process's /health (vllm.afd.attention.status).
            from vllm.afd.attention.status import prepare_status_dir

            prepare_status_dir()
        return config


def _transfer_dtypes(value: "str | dict[str, str]") -> dict[str, str]:
    """transfer_dtype checked and, when given per direction, completed (a
    direction not named is 'auto'); one string stands for both directions."""
    from vllm.afd.transport.wire import TRANSFER_AUTO, TRANSFER_DTYPES

    def check(v: Any, where: str) -> str:
        if v not in TRANSFER_DTYPES:
            raise ValueError(f"AFDConfig.transfer_dtype{where}: {v!r} is not one of "
                             f"{', '.join(map(repr, TRANSFER_DTYPES))}")
        return v

    if isinstance(value, str):
        v = check(value, "")
        return {"to_ffn": v, "to_attention": v}
    unknown = sorted(set(value) - {"to_ffn", "to_attention"})
    if unknown:
        raise ValueError(f"AFDConfig.transfer_dtype: unknown direction(s) {unknown}; valid: "
                         f"'to_ffn', 'to_attention'")
    return {d: check(value.get(d, TRANSFER_AUTO), f"[{d!r}]")
            for d in ("to_ffn", "to_attention")}


def _checked_keys(values: Any, source: str) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise ValueError(f"{source}: expected a JSON object, got {values!r}")
    known = {f.name for f in fields(AFDConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; valid keys: {sorted(known)}")
    return dict(values)


def _from_plugin_keys(values: Any) -> dict[str, Any]:
    """Map afd-plugin's `additional_config["afd"]` keys onto AFDConfig fields."""
    if not isinstance(values, dict):
        raise ValueError(f'--additional-config "afd": expected an object, got {values!r}')
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in _PLUGIN_KEYS:
            raise ValueError(
                f'--additional-config "afd": unknown key {key!r}; valid keys: '
                f"{sorted(_PLUGIN_KEYS)}")
        name = _PLUGIN_KEYS[key]
        if name in out:
            raise ValueError(f'--additional-config "afd": {key!r} given twice (alias)')
        if name == "connector":
            value = _PLUGIN_CONNECTORS.get(value, value)
        if name == "gate_on":
            value = "attention" if _as_bool(value, key) else "ffn"
        out[name] = value
    return out


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false",
                                                    "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ValueError(f'--additional-config "afd": {key!r} must be a boolean, got {value!r}')
