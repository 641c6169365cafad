// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// A step's layer calls over the shm lane, prepared once per step.
//
// lane.cpp made each message end one C call, but each call still came from a
// stack of Python helpers (checks, the template and slot lookups, the
// protocol state): after a layer's compute has streamed its weights through
// the caches, every Python function on that path costs microseconds, and the
// helpers around one layer call cost 150-250 us on the 2-core AMD VM. What
// can be fixed for a whole step is fixed here once, when the step begins: per
// micro-batch the frame headers (templates already patched with step and
// micro-batch), the payload slots and sizes, the wait's spin and bound. A
// layer call is then one C call with four numbers:
//
//   lane_post_call(prepared, ubatch, layer, src): copy the payload into the
//                   micro-batch's slot, patch the layer into its header, post
//   lane_take_call(prepared, ubatch, layer, dst): wait for the frame of that
//                   layer and micro-batch, compare, consume, copy it out
//
// Two calls, not one, so that the caller's bookkeeping runs between them,
// while the peer computes, instead of on the path from one side's compute to
// the other's. Measured on the VM with 20 MB of weights streamed on each side
// per layer: link overhead ~240 us per layer through the helpers, 30-90 us
// with direct calls on both sides.
//
// Whatever is not the common case leaves the rest to the Python path: a full
// ring (nothing sent), or a receive that did not end with the expected frame
// in time (a timeout, a closed link, an error frame or goodbye: left in the
// ring, the caller's general receive takes over, as after lane_recv_frame).
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <new>

#include "frame_codec.h"
#include "lane.h"

namespace afd_lane {
namespace {

constexpr int kMaxUbatches = 4;  // wire.MAX_UBATCHES
constexpr int kMaxHeader = 512;  // shm_fast.frame_template's bound
const char* kPrepared = "vllm_afd.lane_calls";

// One direction's frame of one micro-batch: the header with step and
// micro-batch patched in (the layer is patched per call), its payload slot
// and size.
struct Frame {
  bool usable = false;
  uint8_t header[kMaxHeader];
  Py_ssize_t len = 0, layer_at = 0;
  uint64_t slot = 0, nbytes = 0;
  FrameCodec codec;  // fp8, routing: packed into / unpacked from the slot (frame_codec.h)
};

struct Prepared {
  PyObject* owner;  // keeps the rings (and so the lane's memory) mapped
  PyObject* lane_capsule;
  Lane* lane;
  int64_t spin_ns;
  int timeout_ms;
  Frame send[kMaxUbatches], recv[kMaxUbatches];
  // The same micro-batches' frames with routing (gate_on "attention": MoE
  // layers' hidden states carry it, dense layers' do not), where prepared.
  Frame send_routed[kMaxUbatches], recv_routed[kMaxUbatches];
  // Time spent posting and waiting, for the link statistics (read per step).
  int64_t send_ns = 0, wait_ns = 0;
  uint64_t calls = 0;
};

Prepared* prepared_of(PyObject* capsule) {
  return static_cast<Prepared*>(PyCapsule_GetPointer(capsule, kPrepared));
}

void free_prepared(PyObject* capsule) {
  Prepared* p = prepared_of(capsule);
  if (p == nullptr) return;
  Py_XDECREF(p->owner);
  Py_XDECREF(p->lane_capsule);
  p->~Prepared();
  free(p);
}

void put_layer(uint8_t* header, Py_ssize_t at, unsigned long layer) {
  put_be(header + at, layer, 4);
}

// frames: a sequence (one per micro-batch) of None or (template bytes,
// step_at, layer_at, ubatch_at, slot address, nbytes[, codec spec]); the
// spec: FrameCodec::load's.
bool load_frames(PyObject* frames, Frame* out, unsigned long long step) {
  PyObject* seq = PySequence_Fast(frames, "lane_prepare: frames must be a sequence");
  if (seq == nullptr) return false;
  const Py_ssize_t n = PySequence_Size(seq);
  if (n < 0 || n > kMaxUbatches) {
    Py_DECREF(seq);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "lane_prepare: too many micro-batches");
    return false;
  }
  for (Py_ssize_t u = 0; u < n; ++u) {
    PyObject* item = PySequence_GetItem(seq, u);
    if (item == nullptr) {
      Py_DECREF(seq);
      return false;
    }
    if (item != Py_None) {
      Template t;
      unsigned long long slot, nbytes;
      PyObject* spec = nullptr;
      Frame& f = out[u];
      if (!PyArg_ParseTuple(item, "O!nnnKK|O", &PyBytes_Type, &t.bytes, &t.step_at, &t.layer_at,
                            &t.ubatch_at, &slot, &nbytes, &spec) ||
          !t.load() || !f.codec.load(spec, nbytes)) {
        Py_DECREF(item);
        Py_DECREF(seq);
        return false;
      }
      if (t.len > kMaxHeader || !patch(t, f.header, step, 0, static_cast<unsigned long>(u))) {
        Py_DECREF(item);
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "lane_prepare: bad template");
        return false;
      }
      f.usable = true;
      f.len = t.len;
      f.layer_at = t.layer_at;
      f.slot = slot;
      f.nbytes = nbytes;
    }
    Py_DECREF(item);
  }
  Py_DECREF(seq);
  return true;
}

// Post frame f for layer with its payload copied from src (not when src is
// the slot itself; an fp8 or routed frame's packed from it and the routing
// at weights and ids). 0, 1 (ring full: nothing sent) or -errno (published,
// the wake-up failed: the peer is gone, its receive path says so).
int post(Prepared* p, Frame& f, unsigned long layer, uint64_t src, uint64_t weights,
         uint64_t ids) {
  Lane* lane = p->lane;
  if (!lane->has_space()) return 1;
  if (f.codec.packs)
    f.codec.encode(reinterpret_cast<const uint8_t*>(src), reinterpret_cast<uint8_t*>(f.slot),
                   reinterpret_cast<const uint8_t*>(weights),
                   reinterpret_cast<const uint8_t*>(ids));
  else if (f.nbytes && src != f.slot)
    lane->copy_payload(reinterpret_cast<uint8_t*>(f.slot), reinterpret_cast<const uint8_t*>(src),
                       f.nbytes);
  put_layer(f.header, f.layer_at, layer);
  return lane->post(f.header, f.len);
}

bool same(const uint8_t* header, uint32_t n, const Frame& f) {
  return f.usable && static_cast<Py_ssize_t>(n) == f.len && memcmp(header, f.header, n) == 0;
}

// Wait for micro-batch u's frame of layer, the plain one or (where prepared)
// the routed one; consume it and copy (fp8: unpack) its payload's hidden
// states to dst (unless dst is 0; a routed frame's routing stays in the slot).
// 1 (the plain frame came), 2 (the routed one), 0 (anything else).
int take(Prepared* p, unsigned long u, unsigned long layer, uint64_t dst) {
  Lane* lane = p->lane;
  Frame& plain = p->recv[u];
  Frame& routed = p->recv_routed[u];
  if (plain.usable) put_layer(plain.header, plain.layer_at, layer);
  if (routed.usable) put_layer(routed.header, routed.layer_at, layer);
  if (lane->wait(p->spin_ns, p->timeout_ms) != 1) return 0;
  uint32_t n;
  const uint8_t* header = lane->next_header(&n);
  if (header == nullptr) return 0;
  const bool is_plain = same(header, n, plain);
  if (!is_plain && !same(header, n, routed))
    return 0;  // another message: left in the ring for the Python path
  Frame& f = is_plain ? plain : routed;
  if (f.codec.packs) {
    if (dst)
      f.codec.decode(reinterpret_cast<const uint8_t*>(f.slot), reinterpret_cast<uint8_t*>(dst));
  } else if (f.nbytes) {
    lane->read_payload(reinterpret_cast<uint8_t*>(dst), reinterpret_cast<const uint8_t*>(f.slot),
                       f.nbytes);
  }
  lane->consume();
  return is_plain ? 1 : 2;
}

bool usable(const Frame* frames, unsigned long u, const Frame* twins = nullptr) {
  if (u >= static_cast<unsigned long>(kMaxUbatches) ||
      !(frames[u].usable || (twins != nullptr && twins[u].usable))) {
    PyErr_SetString(PyExc_ValueError, "lane call: micro-batch not prepared");
    return false;
  }
  return true;
}

}  // namespace

// lane_prepare(owner, lane, step, spin_ns, timeout_ms, sends, recvs[,
// routed_sends, routed_recvs]) -> prepared
// sends/recvs: per micro-batch None or (template, step_at, layer_at,
// ubatch_at, slot, nbytes[, codec spec]); the routed ones the same frames
// with routing (None: none). owner stays referenced while the result lives.
PyObject* lane_prepare(PyObject*, PyObject* args) {
  PyObject *owner, *capsule, *sends, *recvs, *routed_sends = Py_None, *routed_recvs = Py_None;
  unsigned long long step;
  long long spin_ns;
  int timeout_ms;
  if (!PyArg_ParseTuple(args, "OOKLiOO|OO", &owner, &capsule, &step, &spin_ns, &timeout_ms,
                        &sends, &recvs, &routed_sends, &routed_recvs))
    return nullptr;
  Lane* lane = lane_of(capsule);
  if (lane == nullptr) return nullptr;
  void* memory = malloc(sizeof(Prepared));
  if (memory == nullptr) return PyErr_NoMemory();
  Prepared* p = new (memory) Prepared();
  p->owner = nullptr;
  p->lane_capsule = nullptr;
  if (!load_frames(sends, p->send, step) || !load_frames(recvs, p->recv, step) ||
      (routed_sends != Py_None && !load_frames(routed_sends, p->send_routed, step)) ||
      (routed_recvs != Py_None && !load_frames(routed_recvs, p->recv_routed, step))) {
    p->~Prepared();
    free(memory);
    return nullptr;
  }
  p->lane = lane;
  p->spin_ns = spin_ns;
  p->timeout_ms = timeout_ms;
  PyObject* result = PyCapsule_New(p, kPrepared, free_prepared);
  if (result == nullptr) {
    p->~Prepared();
    free(memory);
    return nullptr;
  }
  Py_INCREF(owner);
  Py_INCREF(capsule);
  p->owner = owner;
  p->lane_capsule = capsule;
  return result;
}

// lane_post_call(prepared, ubatch, layer, src[, weights, ids]) -> 0 (sent) |
// 1 (ring full: nothing sent) | -errno (sent, but the wake-up failed: the peer
// is gone, and its receive says so). With weights (not 0): the routed frame,
// its routing from weights and ids.
PyObject* lane_post_call(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long ubatch, layer;
  unsigned long long src, weights = 0, ids = 0;
  if (!PyArg_ParseTuple(args, "OkkK|KK", &capsule, &ubatch, &layer, &src, &weights, &ids))
    return nullptr;
  Prepared* p = prepared_of(capsule);
  if (p == nullptr || !usable(weights ? p->send_routed : p->send, ubatch)) return nullptr;
  const int64_t t0 = afd_now_ns();
  const int status = post(p, (weights ? p->send_routed : p->send)[ubatch], layer, src, weights,
                          ids);
  p->send_ns += afd_now_ns() - t0;
  if (status != 1) ++p->calls;
  return PyLong_FromLong(status);
}

// lane_take_call(prepared, ubatch, layer, dst) -> 1 (2: its routed frame)
// when the frame of (ubatch, layer) came and was consumed, its payload copied
// to dst (left in its slot when dst is 0); 0 after the wait's bound, on a
// closed link or when another message came (left in the ring for the Python
// path).
PyObject* lane_take_call(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long ubatch, layer;
  unsigned long long dst;
  if (!PyArg_ParseTuple(args, "OkkK", &capsule, &ubatch, &layer, &dst)) return nullptr;
  Prepared* p = prepared_of(capsule);
  if (p == nullptr || !usable(p->recv, ubatch, p->recv_routed)) return nullptr;
  const int64_t t0 = afd_now_ns();
  int taken;
  Py_BEGIN_ALLOW_THREADS taken = take(p, ubatch, layer, dst);
  Py_END_ALLOW_THREADS p->wait_ns += afd_now_ns() - t0;
  return PyLong_FromLong(taken);
}

// lane_call_times(prepared) -> (send_ns, wait_ns, calls) so far
PyObject* lane_call_times(PyObject*, PyObject* args) {
  PyObject* capsule;
  if (!PyArg_ParseTuple(args, "O", &capsule)) return nullptr;
  Prepared* p = prepared_of(capsule);
  if (p == nullptr) return nullptr;
  return Py_BuildValue("(LLK)", static_cast<long long>(p->send_ns),
                       static_cast<long long>(p->wait_ns),
                       static_cast<unsigned long long>(p->calls));
}

}  // namespace afd_lane
