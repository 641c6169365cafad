# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The connector registry: names to classes, imported on first use.

Built in: shm, tcp, loopback, nccl, ipc. Others come from register_connector() or
from the `vllm_afd.connectors` entry-point group of installed packages
(name = "package.module:ClassName"), so `AFDConfig.connector` can name a
transport this project does not ship. A connector class implements the
transport hooks of hooks.py.
"""

import importlib
import logging
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.afd.transport.connectors.base import AFDConnector

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vllm_afd.connectors"

_CONNECTORS: dict[str, str] = {
    "shm": "vllm.afd.transport.connectors.shm:ShmConnector",
    "tcp": "vllm.afd.transport.connectors.tcp:TcpConnector",
    "loopback": "vllm.afd.transport.connectors.loopback:LoopbackConnector",
    "nccl": "vllm.afd.transport.connectors.nccl:NcclConnector",
    "ipc": "vllm.afd.transport.connectors.ipc:IpcConnector",
}
BUILT_IN = tuple(_CONNECTORS)
_entry_points_loaded = False


def register_connector(name: str, target: str, *, replace: bool = False) -> None:
    """Register a connector class as "package.module:ClassName" (imported on
    first use, so registering costs nothing)."""
    module, _, cls = target.partition(":")
    if not name or not module or not cls.isidentifier():
        raise ValueError(f"register_connector({name!r}): target must look like "
                         f"'package.module:ClassName', got {target!r}")
    if name in _CONNECTORS and _CONNECTORS[name] != target and not replace:
        raise ValueError(f"AFD connector {name!r} is already registered as "
                         f"{_CONNECTORS[name]!r}; pass replace=True to override it")
    _CONNECTORS[name] = target


def unregister_connector(name: str) -> None:
    """Forget a registered connector (tests; a plugin being unloaded)."""
    if name in BUILT_IN:
        raise ValueError(f"AFD connector {name!r} is built in")
    _CONNECTORS.pop(name, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _CONNECTORS:
            logger.warning("AFD connector entry point %s=%s ignored: the name is taken by %s",
                           ep.name, ep.value, _CONNECTORS[ep.name])
            continue
        register_connector(ep.name, ep.value)


def connector_names() -> list[str]:
    _load_entry_points()
    return sorted(_CONNECTORS)


def connector_class(name: str) -> "type[AFDConnector]":
    _load_entry_points()
    if name not in _CONNECTORS:
        raise ValueError(f"unknown AFD connector {name!r}; valid names: "
                         f"{', '.join(connector_names())}")
    module, _, cls_name = _CONNECTORS[name].partition(":")
    from vllm.afd.transport.connectors.base import AFDConnector

    cls = getattr(importlib.import_module(module), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, AFDConnector)):
        raise TypeError(f"AFD connector {name!r}: {_CONNECTORS[name]} is not an "
                        f"AFDConnector subclass")
    return cls


def create_connector(config: Any, *, name: str | None = None,
                     **kwargs: Any) -> "AFDConnector":
    """The connector named by config.connector (or name), constructed with
    kwargs (hidden_size, dtype, max_tokens, rank, device, ...). Not connected
    yet. config: a LinkConfig, or an AFDConfig."""
    return connector_class(name or config.connector)(config, **kwargs)
