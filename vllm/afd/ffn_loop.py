# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The FFN role's worker loop: receive a step, run each layer's mlp, send back.

Runs in a thread of the worker process that holds the (FFN-only) model. A
failure is kept and reported through status(); the engine turns it into an
unhealthy /health and a log line naming the peer, layer and error.
"""

import threading

import torch

from vllm.afd.connectors.base import AFDConnector, AFDTimeoutError, create_connector
from vllm.afd.model_split import ffn_layers
from vllm.afd.stats import LinkStats, now
from vllm.forward_context import create_forward_context, override_forward_context
from vllm.logger import init_logger

logger = init_logger(__name__)


class FFNLoop:
    def __init__(self, vllm_config, model: torch.nn.Module):
        self.vllm_config = vllm_config
        self.afd_config = vllm_config.afd_config
        self.layers = ffn_layers(model)
        if not self.layers:
            raise RuntimeError("AFD FFN role: the model has no mlp layers to serve")
        mc = vllm_config.model_config
        self.hidden_size = mc.get_hidden_size()
        self.dtype = mc.dtype
        self.max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.connector: AFDConnector | None = None
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: str | None = None  # fatal: the loop stopped
        self.last_error: str | None = None  # the last peer's failure
        self.stats = LinkStats()
        self.ready = threading.Event()

    # --- lifecycle -------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="afd-ffn-loop", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.stop_event.set()
        if self.connector is not None:
            self.connector.close()  # unblocks a pending receive
        if self.thread is not None:
            self.thread.join(timeout)

    def status(self) -> dict:
        return {"running": self.thread is not None and self.thread.is_alive(),
                "ready": self.ready.is_set(), "error": self.error,
                "steps": self.stats.steps, "stats": self.stats.as_dict(),
                "last_peer_error": self.last_error,
                "layers": list(self.layers)}

    # --- the loop --------------------------------------------------------
    def _run(self) -> None:
        self.ready.set()
        while not self.stop_event.is_set():
            try:
                self.connector = create_connector(
                    self.afd_config, hidden_size=self.hidden_size, dtype=self.dtype,
                    max_tokens=self.max_tokens, rank=0)
            except Exception as e:  # a configuration error: nothing to retry
                self.error = f"{type(e).__name__}: {e}"
                logger.error("AFD FFN loop cannot start: %s", self.error)
                return
            try:
                self._serve_peer()
            except AFDTimeoutError:
                continue  # nobody connected within timeout_s: keep waiting
            except Exception as e:
                if self.stop_event.is_set():
                    break
                # A lost or misbehaving peer ends its conversation, not the server.
                self.last_error = f"{type(e).__name__}: {e}"
                logger.warning("AFD FFN: attention peer lost: %s; waiting for the next one",
                               self.last_error)
            finally:
                if self.connector is not None:
                    self.connector.close()
                    self.connector = None

    def _serve_peer(self) -> None:
        self.connector.accept()
        logger.info("AFD FFN loop serving layers %s", list(self.layers))
        while not self.stop_event.is_set():
            header = self.connector.recv_step(0)
            if header.is_goodbye or header.is_shutdown:
                logger.info("AFD FFN: attention peer said goodbye")
                return
            self._serve_step(header)

    @torch.inference_mode()
    def _serve_step(self, header) -> None:
        # Micro-batches come layer by layer: (layer 0, ubatch 0), (layer 0,
        # ubatch 1), ..., (layer 1, ubatch 0), ... While this side computes one,
        # the attention side computes attention for the next (ping-pong).
        # The forward context is entered per layer, only while the mlp runs: the
        # attention side is blocked waiting for this layer then, so even an
        # attention engine in this very process (loopback, m = 1) never sees it.
        ctx = create_forward_context(None, self.vllm_config)
        stats, conn = self.stats, self.connector
        num_ubatches = len(header.num_tokens)
        t_step = now()
        for layer_idx, mlp in self.layers.items():
            for u in range(num_ubatches):
                t0 = now()
                h = conn.recv_hidden(0, layer_idx, u)
                t1 = now()
                with override_forward_context(ctx):
                    out = mlp(h)
                t2 = now()
                conn.send_output(0, layer_idx, u, out)
                stats.wait_s += t1 - t0
                stats.compute_s += t2 - t1
                stats.send_s += now() - t2
        stats.step_wall_s += now() - t_step
        stats.steps += 1
        stats.layer_calls += len(self.layers) * num_ubatches
        stats.tokens += len(self.layers) * sum(header.num_tokens)
