# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Worker methods for AFD, called by the engine through collective_rpc."""


class AFDWorkerMixin:
    """Mixed into vLLM's Worker (and so CPUWorker): the FFN role's loop control."""

    _afd_ffn_loop = None

    def afd_start_ffn_loop(self) -> None:
        from vllm.afd.ffn_loop import FFNLoop

        if self._afd_ffn_loop is None:
            self._afd_ffn_loop = FFNLoop(self.vllm_config, self.model_runner.get_model(),
                                         worker_rank=self.rank)
            self._afd_ffn_loop.start()

    def afd_ffn_loop_status(self) -> dict:
        if self._afd_ffn_loop is None:
            return {"running": False, "ready": False, "error": None, "steps": 0}
        return self._afd_ffn_loop.status()

    def afd_link_stats(self) -> dict:
        """Attention role: the link's cumulative statistics (vllm.afd.stats);
        empty before the first step."""
        from vllm.afd import link

        return link._link.stats.as_dict() if link._link is not None else {}

    def afd_stop_ffn_loop(self) -> None:
        if self._afd_ffn_loop is not None:
            self._afd_ffn_loop.stop()
            self._afd_ffn_loop = None
