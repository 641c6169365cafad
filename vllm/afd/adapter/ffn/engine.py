# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""EngineCore in FFN mode: the executor and its workers, no scheduler, no KV cache.

EngineCore.__init__ returns right after building the executor when the role is
ffn (a patched seam); the workers have loaded only the mlp layers
(model/split.py). This class starts their FFN loops and reports their state.
"""

import time

from vllm.logger import init_logger

logger = init_logger(__name__)


class FFNEngine:
    def __init__(self, vllm_config):
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.executor import Executor

        afd = getattr(vllm_config, "afd_config", None)
        if afd is None or not afd.is_ffn:
            raise ValueError("FFNEngine needs a config with --afd-role ffn")
        if afd.connector == "loopback" and afd.num_ubatches > 1:
            # Both roles in one process share vLLM's process-wide forward
            # context, which the ping-pong threads switch while the FFN runs.
            raise ValueError("AFDConfig.num_ubatches: micro-batching (> 1) needs a connector "
                             "between processes (shm, tcp, nccl or ipc); the loopback "
                             "connector runs both roles in one process")
        self.vllm_config = vllm_config
        self.core = EngineCore(vllm_config, Executor.get_class(vllm_config), log_stats=False)
        self.core.collective_rpc("afd_start_ffn_loop")
        if afd.connector == "loopback":
            # Both roles in this process share vLLM's process-wide forward
            # context, which the FFN's warm-up sets and restores on the loop's
            # thread: a step of the attention engine that overlapped it would
            # lose its context (a slow warm-up, e.g. a custom routing
            # function's, restored None under the attention's first layer).
            self._wait_warmed_up()
        logger.info("AFD FFN engine started: workers run the FFN loop, waiting for "
                    "attention peers on %s:%d (%s)", afd.link_config().host_of(afd.ffn_rank),
                    vllm_config.afd_config.port, vllm_config.afd_config.connector)

    def _wait_warmed_up(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            statuses = self.status()
            errors = [s["error"] for s in statuses if s.get("error")]
            if errors:
                raise RuntimeError(f"AFD FFN engine: {errors[0]}")
            if all(s.get("ready") for s in statuses):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"AFD FFN engine: not warmed up after {timeout_s:.0f}s")
            time.sleep(0.02)

    def status(self) -> list[dict]:
        return self.core.collective_rpc("afd_ffn_loop_status", timeout=10)

    def health(self) -> tuple[bool, str]:
        try:
            statuses = self.status()
        except Exception as e:  # a dead worker
            return False, f"workers unreachable: {e}"
        for rank, s in enumerate(statuses):
            if s.get("error"):
                return False, f"FFN worker {rank}: {s['error']}"
            if not s.get("running"):
                return False, f"FFN worker {rank}: loop not running"
            if not s.get("ready"):
                return False, f"FFN worker {rank}: warming up"
        return True, "ok"

    def shutdown(self) -> None:
        try:
            self.core.collective_rpc("afd_stop_ffn_loop", timeout=15)
        except Exception as e:
            logger.warning("AFD FFN loop stop failed: %s", e)
        self.core.model_executor.shutdown()
