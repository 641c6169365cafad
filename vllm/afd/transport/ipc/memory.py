# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The exchange's memory: a side's control words, the region it owns (the
peer writes it) and the peer's region mapped from the handle the peer sent.

CUDA (never run on a GPU yet): a region is device memory of its own
(`afd::ipc_alloc`, not torch's caching allocator, whose IPC handles name a
whole block), handed over as a CUDA IPC handle and mapped with
`cudaIpcOpenMemHandle`; the control words are pinned host memory, mapped for
the kernels (`afd::ipc_mapped`), so the host's signal() lands while a kernel
waits.

CPU (the CPU as the device: processes on one host): a region is a file in
/dev/shm that both processes map, its handle the file's name; the owner
unlinks it once the peer has mapped it (unlink()), so a killed process leaves
nothing behind after the handshake.
"""

import mmap
import os
from dataclasses import dataclass

import torch

from vllm.afd.kernels import ops
from vllm.afd.transport.ipc.layout import ABORT, CONTROL_WORDS
from vllm.afd.transport.leftovers import owned_name

SHM_DIR = "/dev/shm"
SHM_PREFIX = "vllm-afd-ipc-"
CPU_HANDLE, CUDA_HANDLE = b"cpu:", b"cuda:"


@dataclass
class Control:
    """A side's control words (mode, abort, step) in `device` memory, which
    every kernel reads and its stream writes (set_word); and the abort word's
    mirror, one word the host writes while a take waits (signal) and reads
    after a step (read_word): `host` as the host sees it, `mirror` as the
    kernels do (CUDA: pinned host memory mapped for them, polled only by a
    waiting take, so no other kernel reads across PCIe; a take that sees it
    set, or aborts the step itself, writes both). On the CPU the mirror is
    the control's own abort word."""

    device: torch.Tensor
    mirror: torch.Tensor
    host: torch.Tensor

    @classmethod
    def on(cls, device: torch.device) -> "Control":
        if device.type == "cpu":
            words = torch.zeros(CONTROL_WORDS, dtype=torch.int32)
            abort = words[ABORT:ABORT + 1]
            return cls(words, abort, abort)
        if device.type != "cuda":
            raise ValueError(f"the device-resident exchange runs on cpu or cuda, not {device}")
        ops.load()
        host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        words = torch.zeros(CONTROL_WORDS, dtype=torch.int32, device=device)
        return cls(words, torch.ops.afd.ipc_mapped(host, words), host)


class OwnRegion:
    """nbytes of zeroed memory on device that the peer will map: `memory`
    (uint8) and `handle` (bytes for the handshake)."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device, self.nbytes = device, nbytes
        self._path: str | None = None
        if device.type == "cpu":
            self._path = os.path.join(SHM_DIR, owned_name(SHM_PREFIX))  # leftovers.py
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                self._map = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            self.memory = torch.frombuffer(self._map, dtype=torch.uint8)
            self.handle = CPU_HANDLE + os.path.basename(self._path).encode()
        elif device.type == "cuda":
            ops.load()
            self.memory = torch.ops.afd.ipc_alloc(torch.empty(0, device=device), nbytes)
            self.handle = CUDA_HANDLE + bytes(torch.ops.afd.ipc_handle(self.memory).tolist())
        else:
            raise ValueError(f"the device-resident exchange runs on cpu or cuda, not {device}")

    def unlink(self) -> None:
        """The peer has mapped it: no name is needed any more (CPU)."""
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None


def open_peer(device: torch.device, handle: bytes, nbytes: int) -> torch.Tensor:
    """The peer's region from its handle, mapped here (uint8, nbytes). Raises
    ValueError naming why it cannot be mapped (the connector refuses the peer
    with it)."""
    if handle.startswith(CPU_HANDLE) and device.type == "cpu":
        name = handle[len(CPU_HANDLE):].decode()
        if os.sep in name or not name.startswith(SHM_PREFIX):
            raise ValueError(f"not an exchange region's name: {name!r}")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ValueError(f"the peer's region {path} cannot be opened ({e.strerror}): is "
                             f"the peer on another host or in another /dev/shm?") from e
        try:
            if os.fstat(fd).st_size < nbytes:
                raise ValueError(f"the peer's region {path} has {os.fstat(fd).st_size} bytes, "
                                 f"the layout needs {nbytes}")
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        return torch.frombuffer(mapping, dtype=torch.uint8)
    if handle.startswith(CUDA_HANDLE) and device.type == "cuda":
        ops.load()
        raw = torch.tensor(list(handle[len(CUDA_HANDLE):]), dtype=torch.uint8)
        try:
            return torch.ops.afd.ipc_open(raw, torch.empty(0, device=device), nbytes)
        except RuntimeError as e:
            raise ValueError(f"the peer's GPU memory cannot be mapped here ({e}): the roles "
                             f"need GPUs that can map each other's memory (P2P, no MIG, a "
                             f"shared PID namespace in containers)") from e
    kind = handle.split(b":", 1)[0].decode(errors="replace")
    raise ValueError(f"the peer's region is {kind} memory, this side runs on {device}: "
                     f"the device-resident exchange needs both roles on one kind of device")
