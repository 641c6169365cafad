# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention role's end of the link: one per process, shared by every RemoteFFN.

Each forward pass is one step: the first remote layer of a pass announces the
step (StepHeader), then every layer sends its hidden states and waits for the
FFN's result. The connection is made on first use, so the attention server may
start before the FFN server (it waits up to timeout_s, saying what it waits for).
With gate_on "attention", MoE layers pass their routing along (vllm.afd.routing).
"""

import atexit
import threading

import torch

from vllm.afd.config import AFDConfig
from vllm.afd.stats import LinkStats, now
from vllm.afd.topology import attention_rank
from vllm.logger import init_logger

logger = init_logger(__name__)

_link: "AttentionLink | None" = None
_link_lock = threading.Lock()


class AttentionLink:
    def __init__(self, afd_config: AFDConfig, hidden_size: int, dtype: torch.dtype,
                 max_tokens: int, rank: int = 0):
        self.afd_config = afd_config
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.rank = rank
        self.layers: list[int] = []
        self.routing_topk = 0  # experts per token of the routed layers (0: none)
        self.step_id = 0
        self.connector = None  # the FFN rank that answers (its group's lead)
        self.followers: list = []  # the other ranks of its group: they only listen
        self.stats = LinkStats()
        self._step_start = 0.0
        self._step_calls_left = 0

    def add_layer(self, layer_idx: int, routing_topk: int = 0) -> None:
        """Register a remote layer; routing_topk > 0: it sends routing that wide."""
        if layer_idx not in self.layers:
            self.layers.append(layer_idx)
            self.layers.sort()
        self.routing_topk = max(self.routing_topk, routing_topk)

    def _connected(self):
        from vllm.afd.connectors.base import create_connector

        if self.connector is None:
            kwargs = dict(hidden_size=self.hidden_size, dtype=self.dtype,
                          max_tokens=self.max_tokens, rank=self.rank,
                          routing_topk=self.routing_topk)
            first = create_connector(self.afd_config, **kwargs)
            connectors = {first.ffn_rank: first}
            try:
                first.connect()
                # A tensor/expert-parallel FFN server: every rank of its group
                # gets every token; the lead answers (vllm.afd.topology).
                for rank in first.ffn_group:
                    if rank not in connectors:
                        connectors[rank] = create_connector(self.afd_config, ffn_rank=rank,
                                                            **kwargs)
                        connectors[rank].connect()
            except BaseException:
                for c in connectors.values():
                    c.close()
                raise
            lead = first.ffn_group[0]
            self.connector = connectors.pop(lead)
            self.followers = list(connectors.values())
        return self.connector

    def exchange(self, layer_idx: int, hidden_states: torch.Tensor,
                 routing=None) -> torch.Tensor:
        """Run layer `layer_idx`'s mlp on the FFN server (routing: its MoE
        routing, a wire.Routing, when gate_on is "attention"). Inside a
        micro-batch ping-pong (vllm.afd.ubatch), send, let the next
        micro-batch compute while the FFN works, then receive."""
        from vllm.afd.ubatch import current_turn
        from vllm.afd.wire import StepHeader

        turn = current_turn()
        pp, ubatch = turn if turn is not None else (None, 0)
        try:
            connector = self._connected()
            t0 = now()
            if layer_idx == self.layers[0] and ubatch == 0:
                num_tokens = pp.num_tokens if pp is not None else [hidden_states.shape[0]]
                self.step_id += 1
                header = StepHeader(step_id=self.step_id, num_tokens=num_tokens)
                for follower in self.followers:
                    follower.send_step(header)
                connector.send_step(header)
                self._step_start = t0
                self._step_calls_left = len(self.layers) * len(num_tokens)
                self.stats.tokens += sum(num_tokens) * len(self.layers)
            hidden_states = hidden_states.contiguous()
            # Every member of an expert-parallel FFN group gets the routing.
            for follower in self.followers:
                follower.send_hidden(layer_idx, ubatch, hidden_states, expect_output=False,
                                     routing=routing)
            connector.send_hidden(layer_idx, ubatch, hidden_states, routing=routing)
            t1 = now()
            if pp is not None:
                pp.yield_turn(ubatch)
            t2 = now()
            out = connector.recv_output(layer_idx, ubatch)
            # The received tensor may live in a transport buffer that the next
            # step overwrites; the model keeps layer outputs across layers.
            out = out.to(hidden_states.dtype).clone()
            t3 = now()
        except Exception:
            self.reset()
            raise
        stats = self.stats
        stats.send_s += t1 - t0
        stats.wait_s += t3 - t2
        stats.layer_calls += 1
        stats.routed_calls += routing is not None
        self._step_calls_left -= 1
        if self._step_calls_left == 0:
            stats.steps += 1
            stats.step_wall_s += t3 - self._step_start
        return out

    def reset(self) -> None:
        """Drop the connection; the next step reconnects."""
        connectors = ([self.connector] if self.connector is not None else []) + self.followers
        self.connector, self.followers = None, []
        for c in connectors:
            c.close()

    def close(self) -> None:
        self.reset()


def get_or_create_link(vllm_config) -> AttentionLink:
    global _link
    with _link_lock:
        if _link is None:
            mc = vllm_config.model_config
            _link = AttentionLink(
                vllm_config.afd_config, hidden_size=mc.get_hidden_size(), dtype=mc.dtype,
                max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                rank=attention_rank(vllm_config))
            # Say goodbye at exit, so the FFN server knows the peer left on purpose.
            atexit.register(_link.close)
        return _link


def get_link() -> AttentionLink:
    if _link is None:
        raise RuntimeError("AFD: no attention link in this process (model not built "
                           "with --afd-role attention?)")
    return _link
