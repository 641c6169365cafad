# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Transports between the attention and FFN servers; see base.AFDConnector.

Transports are imported on first use through the registry, so importing this
package costs nothing beyond base.py.
"""

from vllm.afd.transport.connectors.base import (AFDConnectionError, AFDConnector,
                                                AFDTimeoutError)
from vllm.afd.transport.connectors.registry import (connector_names, create_connector,
                                                    register_connector)
from vllm.afd.transport.wire import ProtocolError

__all__ = [
    "AFDConnectionError",
    "AFDConnector",
    "AFDTimeoutError",
    "ProtocolError",
    "connector_names",
    "create_connector",
    "register_connector",
]
