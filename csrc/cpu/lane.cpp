// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// The shm connector's message lane: both rings of one connection (the one
// this side sends on, the one it receives from; vllm/afd/transport/shm_ring.py
// has their layout): posting and taking messages, waiting, and the counters
// the Python path and the prepared calls (step_calls.cpp) share.
//
// Why in C, and why through the Python C API rather than ctypes: on a VM every
// page a message's path touches for the first time after the model's compute
// (which streams the weights through the caches and the TLB) costs
// microseconds. Measured on the 2-core AMD VM after a 64 MiB memset: calling
// an empty Python function 10 us, one ctypes.memmove 39 us, building and
// encoding a LayerFrame 98 us; the Python path of one shm message 200-250 us
// per end against 10-14 us when hot. A step's layer calls are therefore
// prepared once and then made with one C call and four numbers per message
// end (step_calls.cpp, its LaneEnd), which compares each received header with
// the frame it expects byte for byte (prepared.py says why that checks it).
// lane_send_frame posts one frame with its payload copied into a slot (the
// copier's own tests drive it); the Lane itself is in lane.h.
//
// Waiting (spin, then sleep on the socket) is the doorbell's
// (afd_doorbell_wait, doorbell.cpp), with the backoff of preempted spins kept
// here per lane. Sequence counters live here too, so the Python path and the
// prepared calls share them.
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include <new>

#include "lane.h"

namespace afd_lane {

Lane* lane_of(PyObject* capsule) {
  return static_cast<Lane*>(PyCapsule_GetPointer(capsule, kCapsule));
}

void free_lane(PyObject* capsule) {
  free(PyCapsule_GetPointer(capsule, kCapsule));
}

// lane_new(tx_ring, rx_ring, fd, entries, entry_bytes, copy_policy=0) -> lane
// copy_policy: how payloads go into this side's slots (slot_copy.h): 0 auto
// (measured), 1 cached stores, 2 streamed stores.
PyObject* lane_new(PyObject*, PyObject* args) {
  unsigned long long tx, rx;
  int fd, policy = kPolicyAuto;
  unsigned int entries, entry_bytes;
  if (!PyArg_ParseTuple(args, "KKiII|i", &tx, &rx, &fd, &entries, &entry_bytes, &policy))
    return nullptr;
  if (entries == 0 || entry_bytes <= kLengthBytes) {
    PyErr_SetString(PyExc_ValueError, "lane_new: empty ring");
    return nullptr;
  }
  if (policy < kPolicyAuto || policy > kPolicyStreamed) {
    PyErr_SetString(PyExc_ValueError, "lane_new: copy_policy must be 0, 1 or 2");
    return nullptr;
  }
  void* memory = malloc(sizeof(Lane));
  if (memory == nullptr) return PyErr_NoMemory();
  Lane* lane = new (memory) Lane();
  lane->tx = reinterpret_cast<uint8_t*>(tx);
  lane->rx = reinterpret_cast<uint8_t*>(rx);
  lane->fd = fd;
  lane->entries = entries;
  lane->entry_bytes = entry_bytes;
  lane->copier.policy = policy;
  PyObject* capsule = PyCapsule_New(lane, kCapsule, free_lane);
  if (capsule == nullptr) free(memory);
  return capsule;
}

// lane_abort(lane): every wait on it, now or later, returns -1.
PyObject* lane_abort(PyObject*, PyObject* args) {
  PyObject* capsule;
  if (!PyArg_ParseTuple(args, "O", &capsule)) return nullptr;
  Lane* lane = lane_of(capsule);
  if (lane == nullptr) return nullptr;
  __atomic_store_n(&lane->abort, 1u, __ATOMIC_SEQ_CST);
  Py_RETURN_NONE;
}

// lane_send(lane, header) -> 0 | 1 (ring full) | -errno
PyObject* lane_send(PyObject*, PyObject* args) {
  PyObject *capsule, *bytes;
  if (!PyArg_ParseTuple(args, "OO!", &capsule, &PyBytes_Type, &bytes)) return nullptr;
  Lane* lane = lane_of(capsule);
  char* header;
  Py_ssize_t n;
  if (lane == nullptr || PyBytes_AsStringAndSize(bytes, &header, &n) != 0) return nullptr;
  if (n > static_cast<Py_ssize_t>(lane->entry_bytes) - kLengthBytes) {
    PyErr_SetString(PyExc_ValueError, "lane_send: header too long");
    return nullptr;
  }
  return PyLong_FromLong(lane->post(reinterpret_cast<const uint8_t*>(header), n));
}

// lane_send_frame(lane, template, step_at, layer_at, ubatch_at, step, layer,
//                 ubatch, src, dst, nbytes) -> 0 | 1 (ring full) | -errno
// Copies nbytes from src to dst (the payload slot; nothing when they are the
// same), then posts the template patched with (step, layer, ubatch).
PyObject* lane_send_frame(PyObject*, PyObject* args) {
  PyObject* capsule;
  Template t;
  unsigned long long step, src, dst, nbytes;
  unsigned long layer, ubatch;
  if (!PyArg_ParseTuple(args, "OO!nnnKkkKKK", &capsule, &PyBytes_Type, &t.bytes, &t.step_at,
                        &t.layer_at, &t.ubatch_at, &step, &layer, &ubatch, &src, &dst, &nbytes))
    return nullptr;
  Lane* lane = lane_of(capsule);
  if (lane == nullptr || !t.load()) return nullptr;
  uint8_t header[512];
  if (t.len > static_cast<Py_ssize_t>(sizeof header) ||
      t.len > static_cast<Py_ssize_t>(lane->entry_bytes) - kLengthBytes ||
      !patch(t, header, step, layer, ubatch)) {
    PyErr_SetString(PyExc_ValueError, "lane_send_frame: bad template");
    return nullptr;
  }
  int status = 1;
  if (lane->has_space()) {
    if (nbytes && src != dst)
      lane->copy_payload(reinterpret_cast<uint8_t*>(dst), reinterpret_cast<const uint8_t*>(src),
                         nbytes);
    status = lane->post(header, t.len);
  }
  return PyLong_FromLong(status);
}

// lane_wait(lane, spin_ns, timeout_ms) -> 1 (a message is there) | 0 | -1
PyObject* lane_wait(PyObject*, PyObject* args) {
  PyObject* capsule;
  long long spin_ns;
  int timeout_ms;
  if (!PyArg_ParseTuple(args, "OLi", &capsule, &spin_ns, &timeout_ms)) return nullptr;
  Lane* lane = lane_of(capsule);
  if (lane == nullptr) return nullptr;
  int status;
  Py_BEGIN_ALLOW_THREADS status = lane->wait(spin_ns, timeout_ms);
  Py_END_ALLOW_THREADS return PyLong_FromLong(status);
}

// lane_take(lane, address, size) -> the header's length n, copied to the
// buffer at address (size bytes) and consumed; -1 - n when n is out of bounds
// (not consumed).
PyObject* lane_take(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long long address;
  Py_ssize_t size;
  if (!PyArg_ParseTuple(args, "OKn", &capsule, &address, &size)) return nullptr;
  Lane* lane = lane_of(capsule);
  if (lane == nullptr) return nullptr;
  uint32_t n;
  const uint8_t* header = lane->next_header(&n);
  long long result = -1 - static_cast<long long>(n);
  if (header != nullptr && static_cast<Py_ssize_t>(n) <= size) {
    memcpy(reinterpret_cast<void*>(address), header, n);
    lane->consume();
    result = n;
  }
  return PyLong_FromLongLong(result);
}

// lane_counters(lane) -> (sent, received, preemptions, backoffs)
PyObject* lane_counters(PyObject*, PyObject* args) {
  PyObject* capsule;
  if (!PyArg_ParseTuple(args, "O", &capsule)) return nullptr;
  Lane* lane = lane_of(capsule);
  if (lane == nullptr) return nullptr;
  return Py_BuildValue("(kkKK)", static_cast<unsigned long>(lane->sent),
                       static_cast<unsigned long>(lane->received),
                       static_cast<unsigned long long>(lane->preemptions),
                       static_cast<unsigned long long>(lane->backoffs));
}

// lane_copy_stats(lane) -> (cached bytes, streamed bytes, cost cached, cost
// streamed (ns per byte, send and read; 0.0 before a sample), samples cached,
// samples streamed): how this side's payloads went into its slots.
PyObject* lane_copy_stats(PyObject*, PyObject* args) {
  PyObject* capsule;
  if (!PyArg_ParseTuple(args, "O", &capsule)) return nullptr;
  Lane* lane = lane_of(capsule);
  if (lane == nullptr) return nullptr;
  const SlotCopier& c = lane->copier;
  return Py_BuildValue("(KKddkk)", static_cast<unsigned long long>(c.bytes[kCached]),
                       static_cast<unsigned long long>(c.bytes[kStreamed]), c.cost[kCached],
                       c.cost[kStreamed], static_cast<unsigned long>(c.samples[kCached]),
                       static_cast<unsigned long>(c.samples[kStreamed]));
}

// lane_note_spin(lane, now_ns, preempted=True) -> whether the lane may spin
// at now_ns after noting a spin then, preempted or not (tests of the backoff rule).
PyObject* lane_note_spin(PyObject*, PyObject* args) {
  PyObject* capsule;
  long long now;
  int preempted = 1;
  if (!PyArg_ParseTuple(args, "OL|p", &capsule, &now, &preempted)) return nullptr;
  Lane* lane = lane_of(capsule);
  if (lane == nullptr) return nullptr;
  lane->note_spin(preempted != 0, now);
  return PyBool_FromLong(lane->may_spin(now));
}

// lane_may_spin(lane, now_ns) -> whether the lane may spin at now_ns (tests).
PyObject* lane_may_spin(PyObject*, PyObject* args) {
  PyObject* capsule;
  long long now;
  if (!PyArg_ParseTuple(args, "OL", &capsule, &now)) return nullptr;
  Lane* lane = lane_of(capsule);
  if (lane == nullptr) return nullptr;
  return PyBool_FromLong(lane->may_spin(now));
}

}  // namespace afd_lane

using namespace afd_lane;

PyMethodDef afd_lane_methods[] = {
    {"lane_new", lane_new, METH_VARARGS, nullptr},
    {"lane_abort", lane_abort, METH_VARARGS, nullptr},
    {"lane_send", lane_send, METH_VARARGS, nullptr},
    {"lane_send_frame", lane_send_frame, METH_VARARGS, nullptr},
    {"lane_wait", lane_wait, METH_VARARGS, nullptr},
    {"lane_take", lane_take, METH_VARARGS, nullptr},
    {"lane_counters", lane_counters, METH_VARARGS, nullptr},
    {"lane_copy_stats", lane_copy_stats, METH_VARARGS, nullptr},
    {"lane_note_spin", lane_note_spin, METH_VARARGS, nullptr},
    {"lane_may_spin", lane_may_spin, METH_VARARGS, nullptr},
    {"copy_floor", copy_floor, METH_VARARGS, nullptr},
    {"step_calls_prepare", step_calls_prepare, METH_VARARGS, nullptr},
    {"step_calls_post", step_calls_post, METH_VARARGS, nullptr},
    {"step_calls_take", step_calls_take, METH_VARARGS, nullptr},
    {"step_calls_times", step_calls_times, METH_VARARGS, nullptr},
    {nullptr, nullptr, 0, nullptr}};
