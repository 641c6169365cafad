# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The connector registry: names to classes, imported on first use."""

import importlib
from typing import Any

from typing import TYPE_CHECKING

from vllm.afd.config import AFDConfig

if TYPE_CHECKING:  # base imports this module at its end
    from vllm.afd.connectors.base import AFDConnector

_CONNECTORS: dict[str, str] = {
    "shm": "vllm.afd.connectors.shm:ShmConnector",
    "tcp": "vllm.afd.connectors.tcp:TcpConnector",
    "loopback": "vllm.afd.connectors.loopback:LoopbackConnector",
    "nccl": "vllm.afd.connectors.nccl:NcclConnector",
}


def register_connector(name: str, target: str, *, replace: bool = False) -> None:
    """Register a connector class as "package.module:ClassName" (imported on
    first use, so registering costs nothing)."""
    module, _, cls = target.partition(":")
    if not module or not cls.isidentifier():
        raise ValueError(f"register_connector({name!r}): target must look like "
                         f"'package.module:ClassName', got {target!r}")
    if name in _CONNECTORS and _CONNECTORS[name] != target and not replace:
        raise ValueError(f"AFD connector {name!r} is already registered as "
                         f"{_CONNECTORS[name]!r}; pass replace=True to override it")
    _CONNECTORS[name] = target


def connector_names() -> list[str]:
    return sorted(_CONNECTORS)


def connector_class(name: str) -> "type[AFDConnector]":
    if name not in _CONNECTORS:
        raise ValueError(f"unknown AFD connector {name!r}; valid names: "
                         f"{', '.join(connector_names())}")
    module, _, cls_name = _CONNECTORS[name].partition(":")
    from vllm.afd.connectors.base import AFDConnector

    cls = getattr(importlib.import_module(module), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, AFDConnector)):
        raise TypeError(f"AFD connector {name!r}: {_CONNECTORS[name]} is not an "
                        f"AFDConnector subclass")
    return cls


def create_connector(afd_config: AFDConfig, *, name: str | None = None,
                     **kwargs: Any) -> "AFDConnector":
    """The connector named by afd_config.connector (or name), constructed with
    kwargs (hidden_size, dtype, max_tokens, rank, ...). Not connected yet."""
    return connector_class(name or afd_config.connector)(afd_config, **kwargs)
