# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Python face of the `afd` op library (csrc/): the transport slot's pack/unpack
(exact or fp8 e4m3 with per-group scales) and the CPU kernels' ISA. Data plane.

The kernels are torch ops (torch.ops.afd.*) with fake implementations, so
torch.compile traces them as opaque calls. The library is the wheel's
vllm/afd/_C; a machine without the wheel (the GPU check) builds it from csrc/
and hands the built file to load(), or names it in VLLM_AFD_OP_LIBRARY (read
by load() without a path: the processes such a machine spawns load it too).
"""

import glob
import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

import torch

from vllm.afd.transport.wire import ROUTING_ALIGN, PayloadLayout

logger = logging.getLogger(__name__)

LIBRARY_ENV = "VLLM_AFD_OP_LIBRARY"  # a built library's file, instead of the wheel's
_loaded = False
_library_path: str | None = None
_composite_library = None  # keeps the PrivateUse1 registrations alive
_module = None


def load(path: str | None = None) -> None:
    """Register torch.ops.afd.*: from the wheel's vllm/afd/_C, or from a
    library built elsewhere (path)."""
    global _loaded, _library_path
    if _loaded:
        return
    path = path or os.environ.get(LIBRARY_ENV) or None
    if path is None:
        try:
            path = importlib.import_module("vllm.afd._C").__file__
        except ImportError:
            # A source tree without a built library (e.g. the working directory
            # of a Ray worker) shadowing an installed vllm-afd: use the
            # installed one's.
            path = _installed_library()
            torch.ops.load_library(path)
    else:
        torch.ops.load_library(path)
    _library_path = path
    _register_fakes()
    _register_composites()
    _loaded = True


def _installed_library() -> str:
    here = Path(__file__).resolve().parent.parent  # this tree's vllm/afd
    for entry in sys.path:
        for candidate in sorted(glob.glob(os.path.join(entry or ".", "vllm", "afd", "_C*.so"))):
            if Path(candidate).resolve().parent != here:
                logger.warning("AFD: vllm.afd._C is not built in %s; using %s", here,
                               candidate)
                return candidate
    raise ImportError(f"the afd op library (vllm.afd._C) is not built in {here} and no "
                      f"installed vllm-afd has one: build it in place (make dev-test) or "
                      f"install the wheel (make install)")


def library_path() -> str:
    """The file of the loaded op library."""
    load()
    return _library_path


def module():
    """The loaded library as a Python module (its plain functions, such as the
    shm lane's of csrc/cpu/lane.cpp)."""
    global _module
    if _module is None:
        path = library_path()
        try:
            _module = importlib.import_module("vllm.afd._C")
        except ImportError:  # the installed library a source tree falls back on
            spec = importlib.util.spec_from_file_location("vllm.afd._C", path)
            _module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(_module)
    return _module


def _register_composites() -> None:
    """pack/unpack for PrivateUse1 (Ascend NPUs) out of torch ops (composite.py),
    where the library brings no kernel of its own for it."""
    global _composite_library
    from vllm.afd.kernels import composite

    missing = [name for name in ("pack", "unpack")
               if not torch._C._dispatch_has_kernel_for_dispatch_key(f"afd::{name}",
                                                                     "PrivateUse1")]
    if missing:
        _composite_library = torch.library.Library("afd", "IMPL")
        for name in missing:
            _composite_library.impl(name, getattr(composite, name), "PrivateUse1")


def _register_fakes() -> None:
    @torch.library.register_fake("afd::pack")
    def _pack_fake(hidden, topk_ids, topk_weights, group_size: int, slot) -> None:
        return None

    @torch.library.register_fake("afd::unpack")
    def _unpack_fake(slot, group_size: int, hidden, topk_ids, topk_weights) -> None:
        return None

    @torch.library.register_fake("afd::ipc_post")
    def _ipc_post_fake(control, src, dst, record, flag, layer: int, rows: int,
                       topk: int) -> None:
        return None

    @torch.library.register_fake("afd::ipc_take")
    def _ipc_take_fake(control, mirror, flag, record, layer: int, rows: int,
                       deadline_s: float) -> None:
        return None


def cpu_isa() -> str:
    """The instruction set of the CPU pack/unpack kernels: "avx512", "avx2" or
    "scalar" (chosen on first use: the widest this CPU runs, or the one
    VLLM_AFD_CPU_ISA names). Every ISA writes the same bytes."""
    load()
    return torch.ops.afd.cpu_isa()


def cpu_isas() -> list[str]:
    """The ISAs this CPU runs, widest first ("scalar" always last)."""
    load()
    return list(torch.ops.afd.cpu_isas())


def set_cpu_isa(isa: str) -> str:
    """Switch the CPU pack/unpack kernels to `isa` (one of cpu_isas()) for this
    process; returns the previous one. For tests and benchmarks."""
    load()
    return torch.ops.afd.set_cpu_isa(isa)


# --------------------------------------------------------------- pack / unpack
# The slot layout is the wire's (csrc/pack.h mirrors it): exact routed slots are
# byte for byte protocol v5's routed LayerFrame payloads, fp8 slots its fp8 ones.
PackLayout = PayloadLayout
PACK_ALIGN = ROUTING_ALIGN  # csrc/pack.h kPackAlign
FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0, csrc/pack.h kFp8E4m3Max


def pack(hidden: torch.Tensor, slot: torch.Tensor, group_size: int = 0,
         topk_ids: torch.Tensor | None = None,
         topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [T, H] (and routing) into slot, a uint8 tensor of exactly
    PackLayout.of(...).total bytes; group_size 0: exact, > 0: fp8 e4m3 with
    one fp32 scale per group_size elements of a token."""
    load()
    torch.ops.afd.pack(hidden, topk_ids, topk_weights, group_size, slot)
    return slot


def unpack(slot: torch.Tensor, hidden: torch.Tensor, group_size: int = 0,
           topk_ids: torch.Tensor | None = None,
           topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of pack, into caller-owned tensors (hidden's shape and
    dtype say what the slot holds)."""
    load()
    torch.ops.afd.unpack(slot, group_size, hidden, topk_ids, topk_weights)
    return hidden
