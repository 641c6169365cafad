# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""NCCL communicators for the nccl connector, from vLLM's PyNccl (adapter).

The data plane's nccl connector takes a communicator factory instead of
importing vLLM; on a vLLM server this is it. NEVER RUN ON HARDWARE (see
transport/connectors/nccl.py).
"""

import torch


class PyNcclFactory:
    """Communicators from vLLM's PyNccl, rendezvous by pre-shared unique id."""

    device_types = ("cuda",)

    def unique_id(self) -> bytes:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        return bytes(NCCLLibrary().ncclGetUniqueId().internal)

    def create(self, unique_id: bytes, rank: int, world_size: int, device: torch.device):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        comm = PyNcclCommunicator.from_unique_id_bytes(unique_id, rank, world_size, device)
        if comm.disabled:  # e.g. VLLM_DISABLE_PYNCCL: send/recv would silently do nothing
            raise RuntimeError("PyNccl is disabled (VLLM_DISABLE_PYNCCL?); the nccl AFD "
                               "connector needs it")
        return comm

    def destroy(self, comm) -> None:
        comm.destroy()


def connector_kwargs(connector: str) -> dict:
    """Extra constructor arguments the adapter passes for a connector."""
    return {"communicator_factory": PyNcclFactory()} if connector == "nccl" else {}
