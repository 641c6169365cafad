# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A connector from outside vllm-afd (tests): tcp with its own handshake data,
what a plugin transport (RDMA keys, device handles) would carry."""

import msgspec

from vllm.afd.transport.connectors.tcp import TcpConnector
from vllm.afd.transport.wire import ProtocolError


class Keys(msgspec.Struct):
    side: str
    key: int


class KeyedTcpConnector(TcpConnector):
    name = "keyed-tcp"
    extra_config_keys = frozenset({"key"})

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.key = int(self.afd_config.connector_extra_config.get("key", 0))
        self.received: list[Keys] = []

    def _hello_transport(self) -> bytes:
        return msgspec.msgpack.encode(Keys(side="attention", key=self.key))

    def _ack_transport(self, peer: int, hello_transport: bytes) -> bytes:
        theirs = msgspec.msgpack.decode(hello_transport, type=Keys)
        self.received.append(theirs)
        return msgspec.msgpack.encode(Keys(side="ffn", key=self.key + theirs.key))

    def _on_ack(self, ack_transport: bytes) -> None:
        keys = msgspec.msgpack.decode(ack_transport, type=Keys)
        if keys.key != 2 * self.key:
            raise ProtocolError(f"HelloAck.transport (keyed-tcp): key {keys.key}, expected "
                                f"{2 * self.key}")
        self.received.append(keys)
