# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The device-resident exchange on the `afd` op library's CPU kernels
(csrc/cpu/ipc.cpp): the CPU as the device, each side's region a shared-memory
file the other maps by its handle (transport/ipc/memory.py), the two sides on
two threads here (two processes: tools/testing/gpu_check's `ipc` check, which
tests/afd/test_harness.py runs on the CPU). The CUDA kernels (csrc/cuda/ipc.cu)
have never run."""

import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from vllm.afd.transport.ipc import layout
from vllm.afd.transport.ipc.calls import Exchange
from vllm.afd.transport.ipc.layout import Layout, Region
from vllm.afd.transport.ipc.memory import CUDA_HANDLE, SHM_DIR, Control, OwnRegion, open_peer
from vllm.afd.transport.ipc.op_stream import OpStream

CPU = torch.device("cpu")
ROWS, HIDDEN = 3, 32
REPO = Path(__file__).resolve().parents[3]


def pair(num_ubatches=1, timeout_s=10.0):
    lay = Layout(num_ubatches, ROWS * HIDDEN * 4)
    owned = [OwnRegion(CPU, lay.total) for _ in range(2)]
    mapped = [open_peer(CPU, r.handle, lay.total) for r in reversed(owned)]
    for r in owned:
        r.unlink()
    sides = [Exchange(role, OpStream(CPU), Control.on(CPU), Region(own.memory, lay),
                      Region(peer, lay), timeout_s)
             for role, own, peer in zip(("attention", "ffn"), owned, mapped)]
    for side in sides:
        side.set_mode(True)
    return sides


def serve(ffn, step, num_ubatches, layers, rows=ROWS):
    ffn.begin_step(step)
    for layer in range(layers):
        for u in range(num_ubatches):
            h = ffn.take(u, layer, torch.float32, (rows, HIDDEN))
            ffn.post(u, layer, h * 2 + layer)


def test_the_kernels_words_are_layout_py_s():
    header = (REPO / "csrc" / "ipc.h").read_text()
    consts = dict(re.findall(r"\b(k[A-Z]\w*) = (-?\d+)", header))
    assert consts, "no constants parsed from csrc/ipc.h"
    pairs = {"kClear": layout.CLEAR, "kReady": layout.READY, "kIdle": layout.IDLE,
             "kRun": layout.RUN, "kNotAborted": layout.NOT_ABORTED,
             "kReleased": layout.ABORT_RELEASED, "kTimeout": layout.ABORT_TIMEOUT,
             "kMismatch": layout.ABORT_MISMATCH, "kMode": layout.MODE, "kAbort": layout.ABORT,
             "kStep": layout.STEP, "kControlWords": layout.CONTROL_WORDS,
             "kRecordStep": layout.RECORD_STEP, "kRecordLayer": layout.RECORD_LAYER,
             "kRecordRows": layout.RECORD_ROWS, "kRecordTopk": layout.RECORD_TOPK,
             "kRecordWords": layout.RECORD_WORDS}
    assert {k: int(consts[k]) for k in pairs} == pairs


@pytest.mark.parametrize("num_ubatches", [1, 3])
def test_two_threads_exchange_through_shared_regions(num_ubatches):
    attn, ffn = pair(num_ubatches)
    for step in (1, 2**32 + 1):  # the step word wraps at 32 bits
        server = threading.Thread(target=serve, args=(ffn, step, num_ubatches, 4))
        server.start()
        attn.begin_step(step)
        hidden = [torch.randn(ROWS, HIDDEN) for _ in range(num_ubatches)]
        want = [h.clone() for h in hidden]
        for layer in range(4):
            for u, h in enumerate(hidden):
                attn.post(u, layer, h)
            for u, h in enumerate(hidden):
                attn.take_into(u, layer, h)
                want[u] = want[u] * 2 + layer
        server.join(10)
        assert attn.outcome() is None and ffn.outcome() is None
        for got, w in zip(hidden, want):
            assert torch.equal(got, w)


def test_a_take_ends_at_its_deadline_and_release_ends_it_sooner():
    attn, _ = pair(timeout_s=0.3)
    attn.begin_step(1)
    attn.post(0, 0, torch.ones(ROWS, HIDDEN))
    t0 = time.monotonic()
    attn.take(0, 0, torch.float32, (ROWS, HIDDEN))
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert "deadline" in attn.outcome()
    # A later operation of the aborted step does nothing (and does not wait).
    t0 = time.monotonic()
    attn.post(0, 1, torch.ones(ROWS, HIDDEN))
    attn.take(0, 1, torch.float32, (ROWS, HIDDEN))
    assert time.monotonic() - t0 < 0.2
    # The supervisor's release from another thread, long before a 60 s deadline.
    attn.timeout_s = 60.0
    attn.begin_step(2)
    attn.post(0, 0, torch.ones(ROWS, HIDDEN))
    timer = threading.Timer(0.2, attn.release)
    timer.start()
    t0 = time.monotonic()
    attn.take(0, 0, torch.float32, (ROWS, HIDDEN))
    assert time.monotonic() - t0 < 5.0
    assert "released" in attn.outcome()
    attn.begin_step(3)
    assert attn.outcome() is None


def test_idle_mode_touches_nothing_and_never_waits():
    attn, ffn = pair(timeout_s=30.0)
    attn.set_mode(False)
    before = ffn.local.memory.clone()
    t0 = time.monotonic()
    attn.begin_step(1)
    attn.post(0, 0, torch.ones(ROWS, HIDDEN))
    attn.take(0, 0, torch.float32, (ROWS, HIDDEN))
    assert time.monotonic() - t0 < 1.0
    assert torch.equal(ffn.local.memory, before)
    assert attn.outcome() is None


def test_a_record_of_another_step_or_size_aborts():
    attn, ffn = pair(timeout_s=5.0)
    ffn.begin_step(5)
    attn.begin_step(6)
    attn.post(0, 0, torch.ones(ROWS, HIDDEN))
    ffn.take(0, 0, torch.float32, (ROWS, HIDDEN))
    assert "another step" in ffn.outcome()
    ffn.begin_step(6)
    ffn._posting[0] = False  # take the same call again, expecting other rows
    ffn.take(0, 0, torch.float32, (ROWS - 1, HIDDEN))
    assert "another step, layer or size" in ffn.outcome()


def test_the_ops_refuse_bad_arguments():
    control = Control.on(CPU).device
    record, flag = torch.zeros(layout.RECORD_WORDS, dtype=torch.int32), torch.zeros(
        1, dtype=torch.int32)
    src = torch.ones(ROWS, HIDDEN)
    post = torch.ops.afd.ipc_post
    with pytest.raises(RuntimeError, match="dst .* must be a contiguous tensor of src's dtype"):
        post(control, src, torch.empty(ROWS, HIDDEN - 1), record, flag, 0, ROWS, 0)
    with pytest.raises(RuntimeError, match="control must be 3 contiguous int32 words"):
        post(control.long(), src, torch.empty_like(src), record, flag, 0, ROWS, 0)
    with pytest.raises(RuntimeError, match="record must be 4 contiguous int32 words"):
        post(control, src, torch.empty_like(src), record[:3], flag, 0, ROWS, 0)
    with pytest.raises(RuntimeError, match="rows and topk must be >= 0"):
        post(control, src, torch.empty_like(src), record, flag, 0, ROWS, -1)
    mirror = control[layout.ABORT:layout.ABORT + 1]
    with pytest.raises(RuntimeError, match="deadline_s must be > 0"):
        torch.ops.afd.ipc_take(control, mirror, flag, record, 0, ROWS, 0.0)
    with pytest.raises(RuntimeError, match="mirror must be 1 contiguous int32 words"):
        torch.ops.afd.ipc_take(control, control[:2], flag, record, 0, ROWS, 1.0)


def test_peer_regions_open_by_handle_and_leave_no_file():
    lay = Layout(1, 256)
    own = OwnRegion(CPU, lay.total)
    path = os.path.join(SHM_DIR, own.handle.split(b":", 1)[1].decode())
    assert os.path.exists(path)
    peer = open_peer(CPU, own.handle, lay.total)
    peer[5] = 7
    assert int(own.memory[5]) == 7  # one memory, two mappings
    own.unlink()
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="cannot be opened"):
        open_peer(CPU, own.handle, lay.total)
    with pytest.raises(ValueError, match="not an exchange region"):
        open_peer(CPU, b"cpu:../etc/passwd", lay.total)
    with pytest.raises(ValueError, match="one kind of device"):
        open_peer(CPU, CUDA_HANDLE + bytes(64), lay.total)
    small = OwnRegion(CPU, 64)
    try:
        with pytest.raises(ValueError, match="the layout needs"):
            open_peer(CPU, small.handle, lay.total)
    finally:
        small.unlink()
