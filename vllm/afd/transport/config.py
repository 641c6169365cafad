# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""LinkConfig: what the data plane needs to know about a deployment.

The data plane (transport, the attention link, the ping-pong scheduler, the FFN
loop) imports nothing from vLLM, so it cannot take vLLM's config objects. The
adapter turns the user-facing AFDConfig (vllm/afd/adapter/config.py) into this plain
dataclass (AFDConfig.link_config()); the torch-only harness builds one directly.
The field names are AFDConfig's, so their meaning is documented once, there;
their checks are written once, here (check_link_fields, which AFDConfig runs
too), and so are the properties a role implies (LinkRoles, AFDConfig's base).
"""

from dataclasses import dataclass, field, fields
from typing import Any

from vllm.afd.transport.wire import MAX_UBATCHES, TRANSFER_DTYPES

ROLES = ("attention", "ffn")


class LinkRoles:
    """What a role's fields imply, for LinkConfig and AFDConfig alike (role,
    transfer_to_ffn and transfer_to_attention: fields of one, properties of
    the other)."""

    @property
    def is_attention(self) -> bool:
        return self.role == "attention"

    @property
    def is_ffn(self) -> bool:
        return self.role == "ffn"

    @property
    def send_transfer(self) -> str:
        """How this role's payloads travel to its peer."""
        return self.transfer_to_ffn if self.is_attention else self.transfer_to_attention

    @property
    def receive_transfer(self) -> str:
        """How its peer's payloads travel to this role."""
        return self.transfer_to_attention if self.is_attention else self.transfer_to_ffn


@dataclass(frozen=True)
class LinkConfig(LinkRoles):
    role: str = "attention"
    connector: str = "shm"
    host: str = "127.0.0.1"
    ffn_hosts: list[str] = field(default_factory=list)  # per FFN rank; empty: host
    ffn_pool: list[str] = field(default_factory=list)  # "host:port" FFN deployments
    ffn_pool_file: str | None = None  # more of them, one per line, re-read
    port: int = 7700
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    num_ubatches: int = 1
    timeout_s: float = 60.0
    connector_extra_config: dict[str, Any] = field(default_factory=dict)
    token_file: str | None = None
    allow_insecure: bool = False
    # AFDConfig.transfer_dtype, per direction: "auto" (exact) or "fp8".
    transfer_to_ffn: str = "auto"
    transfer_to_attention: str = "auto"

    def __post_init__(self) -> None:
        check_link_fields(self, "LinkConfig")

    @classmethod
    def of(cls, config: Any) -> "LinkConfig":
        """A LinkConfig from one, or from any object with the same fields
        (AFDConfig), field by field."""
        if isinstance(config, cls):
            return config
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def replace(self, **changes: Any) -> "LinkConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return LinkConfig(**values)

    def has_pool(self) -> bool:
        return bool(self.ffn_pool or self.ffn_pool_file)

    def host_of(self, ffn_rank: int) -> str:
        """Where FFN rank ffn_rank listens (ffn_hosts, else host)."""
        return self.ffn_hosts[ffn_rank] if self.ffn_hosts else self.host

def check_link_fields(config: Any, where: str) -> None:
    """The checks of the fields LinkConfig shares with AFDConfig, written once
    for both (`where` names the config in the messages): AFDConfig runs them
    where the user's values come in, LinkConfig where the harness builds one."""
    if config.role not in ROLES:
        raise ValueError(f"{where}.role: {config.role!r} is not one of {ROLES}")
    if not 1 <= config.port <= 65535:
        raise ValueError(f"{where}.port: {config.port} is not in 1-65535")
    for name in ("num_attention_ranks", "num_ffn_ranks"):
        if getattr(config, name) < 1:
            raise ValueError(f"{where}.{name}: must be >= 1, got {getattr(config, name)}")
    if config.ffn_hosts and len(config.ffn_hosts) != config.num_ffn_ranks:
        raise ValueError(f"{where}.ffn_hosts: {len(config.ffn_hosts)} addresses for "
                         f"{config.num_ffn_ranks} FFN ranks (num_ffn_ranks); give one per "
                         f"rank, or none to use host for all")
    if not all(config.ffn_hosts):
        raise ValueError(f"{where}.ffn_hosts: an address must not be empty")
    for endpoint in config.ffn_pool:
        parse_endpoint(endpoint, f"{where}.ffn_pool")
    if not 1 <= config.num_ubatches <= MAX_UBATCHES:
        raise ValueError(f"{where}.num_ubatches: {config.num_ubatches} is not in "
                         f"1-{MAX_UBATCHES}")
    if config.timeout_s <= 0:
        raise ValueError(f"{where}.timeout_s: must be > 0, got {config.timeout_s}")
    for name in ("transfer_to_ffn", "transfer_to_attention"):
        if getattr(config, name) not in TRANSFER_DTYPES:
            raise ValueError(f"{where}.{name}: {getattr(config, name)!r} is not one of "
                             f"{TRANSFER_DTYPES}")


def parse_endpoint(text: str, where: str = "FFN pool member") -> tuple[str, int]:
    """("host", port) of "host:port" ("[v6 address]:port" for IPv6)."""
    host, sep, port = str(text).strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{where}: {text!r} is not host:port (port 1-65535; IPv6 as "
                         f"[address]:port)")
    return host, int(port)
