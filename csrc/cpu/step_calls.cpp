// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// A step's layer calls, prepared once per step: one implementation for every
// transport whose message ends this host posts, the shm lane and a tcp socket.
// What differs between them is how a message end is posted and taken (an End
// below: LaneEnd, SocketEnd); the frames, their checks, the statistics and the
// calls' contract are the same.
//
// Through a connector's general path a layer call's message end is a stack of
// Python helpers (checks, a LayerFrame built, encoded, decoded and checked,
// template and slot lookups, the protocol state); after a layer's compute has
// streamed its weights through the caches each costs microseconds (figures:
// benchmarks/notes.md). What can be fixed for a whole step is fixed here once,
// when the step begins: per micro-batch and direction the frame's bytes up to
// its payload (templates already patched with step and micro-batch; a socket
// frame's with the connector's prefix in front), its payload slot and size,
// its codec (fp8, routing: frame_codec.h). A layer call is then one C call
// with four numbers:
//
//   step_calls_post(calls, ubatch, layer, src[, weights, ids]): patch the
//                   layer into the header, send the payload at src (packed
//                   with the routing at weights and ids, where given)
//   step_calls_take(calls, ubatch, layer, dst): wait for the frame of that
//                   layer and micro-batch, compare it with the expected
//                   bytes, consume it and copy (unpack) its payload into dst
//
// Two calls, not one, so that the caller's bookkeeping runs between them,
// while the peer computes, instead of on the path from one side's compute to
// the other's.
//
// Whatever is not the common case leaves the rest to the connector's general
// path: nothing sent (a full ring or socket buffer), or a receive that did not
// find the expected frame within its bound (a timeout, a closed link, an error
// frame, a goodbye, anything malformed): left where it was (in the ring;
// peeked, not read, on a socket), so the general receive reads it and raises
// what it always did. Only a socket can fail mid-frame (the peer gone or
// stalled after the header was read, or after part of a frame went out): that
// is -errno, the stream can no longer be read frame by frame.
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <new>

#include "frame_codec.h"
#include "lane.h"

namespace afd_lane {
namespace {

constexpr int kMaxUbatches = 4;  // wire.MAX_UBATCHES
constexpr int kMaxHeader = 512;  // prepared.MAX_TEMPLATE_BYTES, a socket's prefix included
const char* kStepCalls = "vllm_afd.step_calls";

// One direction's frame of one micro-batch: the bytes up to its payload with
// step and micro-batch patched in (the layer is patched per call), where its
// payload goes (a lane's slot; 0 on a socket) and its size.
struct Frame {
  bool usable = false;
  uint8_t header[kMaxHeader];
  Py_ssize_t len = 0, layer_at = 0;
  uint64_t slot = 0, nbytes = 0;
  FrameCodec codec;  // fp8, routing: packed / unpacked by the call (frame_codec.h)

  void set_layer(unsigned long layer) { put_be(header + layer_at, layer, 4); }
};

struct Calls {
  PyObject* owner = nullptr;      // keeps the transport (rings mapped, socket open) alive
  PyObject* transport = nullptr;  // the lane's capsule (nullptr on a socket)
  Lane* lane = nullptr;           // the shm lane, or
  int fd = -1;                    // the socket
  int64_t spin_ns = 0;       // how long a wait spins before it sleeps
  int64_t fast_wait_ns = 0;  // how long a receive waits for its frame to begin at all
  int timeout_ms = 0;        // how long a begun frame may take to finish (a socket's)
  Frame send[kMaxUbatches], recv[kMaxUbatches];
  // The same micro-batches' frames with routing (gate_on "attention": MoE
  // layers' hidden states carry it, dense layers' do not), where prepared.
  Frame send_routed[kMaxUbatches], recv_routed[kMaxUbatches];
  // Time spent posting and waiting, and the calls sent, for the link statistics.
  int64_t send_ns = 0, wait_ns = 0;
  uint64_t calls = 0;
};

// A message end over the shm lane: the payload into the frame's slot, the
// header into the ring (lane.h). Posting never blocks: a full ring sends
// nothing.
struct LaneEnd {
  static constexpr bool kBlocks = false;

  // 0 (sent) or 1 (the ring is full: nothing sent). A published frame whose
  // wake-up failed is sent: the peer is gone, and the receive says so.
  static int post(Calls& c, Frame& f, unsigned long layer, uint64_t src, uint64_t weights,
                  uint64_t ids) {
    Lane* lane = c.lane;
    if (!lane->has_space()) return 1;
    if (f.codec.packs)
      f.codec.encode(reinterpret_cast<const uint8_t*>(src), reinterpret_cast<uint8_t*>(f.slot),
                     reinterpret_cast<const uint8_t*>(weights),
                     reinterpret_cast<const uint8_t*>(ids));
    else if (f.nbytes && src != f.slot)
      lane->copy_payload(reinterpret_cast<uint8_t*>(f.slot), reinterpret_cast<const uint8_t*>(src),
                         f.nbytes);
    f.set_layer(layer);
    return lane->post(f.header, f.len) == 1 ? 1 : 0;
  }

  static bool same(const uint8_t* header, uint32_t n, const Frame* f) {
    return f != nullptr && static_cast<Py_ssize_t>(n) == f->len &&
           memcmp(header, f->header, n) == 0;
  }

  // 1 (the plain frame taken), 2 (the routed one) or 0 (nothing taken).
  static int take(Calls& c, Frame* plain, Frame* routed, uint64_t dst) {
    Lane* lane = c.lane;
    // The wait's bound: fast_wait, or the spin where longer (whole ms).
    const int64_t wait_ns = c.spin_ns > c.fast_wait_ns ? c.spin_ns : c.fast_wait_ns;
    if (lane->wait(c.spin_ns, static_cast<int>((wait_ns + 999999) / 1000000)) != 1) return 0;
    uint32_t n;
    const uint8_t* header = lane->next_header(&n);
    if (header == nullptr) return 0;
    const bool is_plain = same(header, n, plain);
    if (!is_plain && !same(header, n, routed)) return 0;  // another message: left in the ring
    Frame& f = is_plain ? *plain : *routed;
    if (f.codec.packs) {
      if (dst)
        f.codec.decode(reinterpret_cast<const uint8_t*>(f.slot), reinterpret_cast<uint8_t*>(dst));
    } else if (f.nbytes) {
      lane->read_payload(reinterpret_cast<uint8_t*>(dst),
                         reinterpret_cast<const uint8_t*>(f.slot), f.nbytes);
    }
    lane->consume();
    return is_plain ? 1 : 2;
  }
};

// A message end on a stream socket: prefix, header and payload in one
// sendmsg; the expected bytes peeked before anything is read.
struct SocketEnd {
  static constexpr bool kBlocks = true;

  static int wait_fd(int fd, short events, int64_t until_ns) {
    const int64_t left_ms = (until_ns - afd_now_ns() + 999999) / 1000000;
    pollfd pfd{fd, events, 0};
    return poll(&pfd, 1, left_ms > 0 ? static_cast<int>(left_ms < 1000 ? left_ms : 1000) : 0);
  }

  // 0 (sent), 1 (nothing sent: the socket's buffer is full or the socket
  // failed; the general send takes over and says why) or -errno (part of the
  // frame went out, the rest could not: the stream is broken).
  static int post(Calls& c, Frame& f, unsigned long layer, uint64_t src, uint64_t weights,
                  uint64_t ids) {
    f.set_layer(layer);
    if (f.codec.packs) {
      f.codec.encode(reinterpret_cast<const uint8_t*>(src),
                     reinterpret_cast<uint8_t*>(f.codec.buffer),
                     reinterpret_cast<const uint8_t*>(weights),
                     reinterpret_cast<const uint8_t*>(ids));
      src = f.codec.buffer;
    }
    iovec iov[2] = {{f.header, static_cast<size_t>(f.len)},
                    {reinterpret_cast<void*>(src), static_cast<size_t>(f.nbytes)}};
    int first = 0;
    const int count = f.nbytes ? 2 : 1;
    size_t sent = 0;
    const size_t total = static_cast<size_t>(f.len) + f.nbytes;
    const int64_t deadline = afd_now_ns() + static_cast<int64_t>(c.timeout_ms) * 1000000;
    while (true) {
      msghdr msg{};
      msg.msg_iov = iov + first;
      msg.msg_iovlen = count - first;
      const ssize_t n = sendmsg(c.fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return sent ? -errno : 1;
        if (sent == 0) return 1;
      } else {
        sent += static_cast<size_t>(n);
        if (sent == total) return 0;
        size_t skip = static_cast<size_t>(n);
        while (skip >= iov[first].iov_len) skip -= iov[first++].iov_len;
        iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + skip;
        iov[first].iov_len -= skip;
      }
      if (afd_now_ns() >= deadline) return -ETIMEDOUT;
      wait_fd(c.fd, POLLOUT, deadline);
    }
  }

  // Whether the n bytes seen so far can begin frame f (nullptr: none prepared).
  static bool may_be(const uint8_t* seen, size_t n, const Frame* f) {
    return f != nullptr &&
           memcmp(seen, f->header, n < static_cast<size_t>(f->len) ? n : f->len) == 0;
  }

  // 1 (the plain frame taken), 2 (the routed one), 0 (not there within the
  // wait's bound, or something else is: nothing read) or -errno (the header
  // was read, the payload did not follow). A packed frame's payload is
  // received into its codec's buffer and its hidden states unpacked into dst
  // (unless dst is 0); any other's straight into dst.
  static int take(Calls& c, Frame* plain, Frame* routed, uint64_t dst) {
    uint8_t seen[kMaxHeader];
    const int64_t start = afd_now_ns();
    const int64_t spin_end = start + c.spin_ns;
    const int64_t wait_end = start + (c.spin_ns > c.fast_wait_ns ? c.spin_ns : c.fast_wait_ns);
    // The two frames' prefixes differ (header and payload lengths), so the
    // bytes seen soon tell which one is coming.
    size_t want = 0;
    if (plain != nullptr) want = static_cast<size_t>(plain->len);
    if (routed != nullptr && static_cast<size_t>(routed->len) > want)
      want = static_cast<size_t>(routed->len);
    Frame* match = nullptr;
    while (true) {
      const ssize_t n = recv(c.fd, seen, want, MSG_PEEK | MSG_DONTWAIT);
      if (n > 0) {
        const size_t got = static_cast<size_t>(n);
        const bool maybe_plain = may_be(seen, got, plain), maybe_routed = may_be(seen, got, routed);
        if (!maybe_plain && !maybe_routed) return 0;  // another message
        if (maybe_plain && got >= static_cast<size_t>(plain->len)) match = plain;
        if (maybe_routed && got >= static_cast<size_t>(routed->len)) match = routed;
        if (match != nullptr) break;
      } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        return 0;  // closed or failed: the general receive reports it
      }
      const int64_t now = afd_now_ns();
      if (now >= wait_end) return 0;
      if (now < spin_end)
        afd_cpu_relax();
      else if (n <= 0)
        wait_fd(c.fd, POLLIN, wait_end);
    }
    Frame& f = *match;
    const size_t len = static_cast<size_t>(f.len);
    if (recv(c.fd, seen, len, MSG_DONTWAIT) != static_cast<ssize_t>(len)) return -EPROTO;
    uint8_t* to = reinterpret_cast<uint8_t*>(f.codec.packs ? f.codec.buffer : dst);
    uint64_t got = 0;
    const int64_t stall_end = afd_now_ns() + static_cast<int64_t>(c.timeout_ms) * 1000000;
    while (got < f.nbytes) {
      const ssize_t n = recv(c.fd, to + got, f.nbytes - got, MSG_DONTWAIT);
      if (n > 0) {
        got += static_cast<uint64_t>(n);
        continue;
      }
      if (n == 0) return -ECONNRESET;
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
      const int64_t now = afd_now_ns();
      if (now >= stall_end) return -ETIMEDOUT;
      if (now < spin_end)
        afd_cpu_relax();
      else
        wait_fd(c.fd, POLLIN, stall_end);
    }
    if (f.codec.packs && dst) f.codec.decode(to, reinterpret_cast<uint8_t*>(dst));
    return match == plain ? 1 : 2;
  }
};

Calls* calls_of(PyObject* capsule) {
  return static_cast<Calls*>(PyCapsule_GetPointer(capsule, kStepCalls));
}

void free_calls(PyObject* capsule) {
  Calls* c = calls_of(capsule);
  if (c == nullptr) return;
  Py_XDECREF(c->owner);
  Py_XDECREF(c->transport);
  c->~Calls();
  free(c);
}

// frames: a sequence (one per micro-batch) of None or (template bytes,
// step_at, layer_at, ubatch_at, slot address, nbytes[, codec spec]); the
// spec: FrameCodec::load's. A socket's frames have no slot (0), and a packed
// one needs its codec's buffer.
bool load_frames(PyObject* frames, Frame* out, unsigned long long step, bool on_socket) {
  PyObject* seq = PySequence_Fast(frames, "step_calls_prepare: frames must be a sequence");
  if (seq == nullptr) return false;
  const Py_ssize_t n = PySequence_Size(seq);
  bool ok = n >= 0 && n <= kMaxUbatches;
  if (!ok && !PyErr_Occurred())
    PyErr_SetString(PyExc_ValueError, "step_calls_prepare: too many micro-batches");
  for (Py_ssize_t u = 0; ok && u < n; ++u) {
    PyObject* item = PySequence_GetItem(seq, u);
    if (item == nullptr) {
      ok = false;
      break;
    }
    if (item != Py_None) {
      Template t;
      unsigned long long slot, nbytes;
      PyObject* spec = nullptr;
      Frame& f = out[u];
      ok = PyArg_ParseTuple(item, "O!nnnKK|O", &PyBytes_Type, &t.bytes, &t.step_at, &t.layer_at,
                            &t.ubatch_at, &slot, &nbytes, &spec) &&
           t.load() && f.codec.load(spec, nbytes);
      if (ok && on_socket && f.codec.packs && nbytes && f.codec.buffer == 0) {
        PyErr_SetString(PyExc_ValueError, "step_calls_prepare: a packed frame needs a buffer");
        ok = false;
      }
      if (ok && (t.len > kMaxHeader ||
                 !patch(t, f.header, step, 0, static_cast<unsigned long>(u)))) {
        PyErr_SetString(PyExc_ValueError, "step_calls_prepare: bad template");
        ok = false;
      }
      if (ok) {
        f.usable = true;
        f.len = t.len;
        f.layer_at = t.layer_at;
        f.slot = slot;
        f.nbytes = nbytes;
      }
    }
    Py_DECREF(item);
  }
  Py_DECREF(seq);
  return ok;
}

Frame* prepared(Frame* frames, unsigned long u) {
  return u < static_cast<unsigned long>(kMaxUbatches) && frames[u].usable ? &frames[u] : nullptr;
}

template <class End>
int post(Calls& c, Frame& f, unsigned long layer, uint64_t src, uint64_t weights, uint64_t ids) {
  if (!End::kBlocks) return End::post(c, f, layer, src, weights, ids);
  int status;
  Py_BEGIN_ALLOW_THREADS status = End::post(c, f, layer, src, weights, ids);
  Py_END_ALLOW_THREADS return status;
}

template <class End>
int take(Calls& c, Frame* plain, Frame* routed, unsigned long layer, uint64_t dst) {
  if (plain != nullptr) plain->set_layer(layer);
  if (routed != nullptr) routed->set_layer(layer);
  int status;
  Py_BEGIN_ALLOW_THREADS status = End::take(c, plain, routed, dst);
  Py_END_ALLOW_THREADS return status;
}

}  // namespace

// step_calls_prepare(owner, transport, step, spin_ns, fast_wait_ms, timeout_ms,
// sends, recvs[, routed_sends, routed_recvs]) -> calls
// transport: a lane's capsule (lane_new) or a connected socket's descriptor.
// sends/recvs: per micro-batch None or (template, step_at, layer_at,
// ubatch_at, slot, nbytes[, codec spec]); the routed ones the same frames
// with routing (None: none). owner stays referenced while the result lives.
PyObject* step_calls_prepare(PyObject*, PyObject* args) {
  PyObject *owner, *transport, *sends, *recvs, *routed_sends = Py_None, *routed_recvs = Py_None;
  unsigned long long step;
  long long spin_ns;
  int fast_wait_ms, timeout_ms;
  if (!PyArg_ParseTuple(args, "OOKLiiOO|OO", &owner, &transport, &step, &spin_ns, &fast_wait_ms,
                        &timeout_ms, &sends, &recvs, &routed_sends, &routed_recvs))
    return nullptr;
  Lane* lane = nullptr;
  int fd = -1;
  if (PyLong_Check(transport)) {
    fd = static_cast<int>(PyLong_AsLong(transport));
    if (fd < 0) {
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "step_calls_prepare: the socket is closed");
      return nullptr;
    }
  } else if ((lane = lane_of(transport)) == nullptr) {
    return nullptr;
  }
  const bool on_socket = lane == nullptr;
  void* memory = malloc(sizeof(Calls));
  if (memory == nullptr) return PyErr_NoMemory();
  Calls* c = new (memory) Calls();
  if (!load_frames(sends, c->send, step, on_socket) ||
      !load_frames(recvs, c->recv, step, on_socket) ||
      (routed_sends != Py_None && !load_frames(routed_sends, c->send_routed, step, on_socket)) ||
      (routed_recvs != Py_None && !load_frames(routed_recvs, c->recv_routed, step, on_socket))) {
    c->~Calls();
    free(memory);
    return nullptr;
  }
  c->lane = lane;
  c->fd = fd;
  c->spin_ns = spin_ns > 0 ? spin_ns : 0;
  c->fast_wait_ns = static_cast<int64_t>(fast_wait_ms) * 1000000;
  c->timeout_ms = timeout_ms;
  PyObject* result = PyCapsule_New(c, kStepCalls, free_calls);
  if (result == nullptr) {
    c->~Calls();
    free(memory);
    return nullptr;
  }
  Py_INCREF(owner);
  c->owner = owner;
  if (!on_socket) {
    Py_INCREF(transport);
    c->transport = transport;
  }
  return result;
}

// step_calls_post(calls, ubatch, layer, src[, weights, ids]) -> 0 (sent) | 1
// (nothing sent) | -errno (a socket's frame went out in part: the stream is
// broken). With weights (not 0): the routed frame, its routing from weights
// and ids (a raw frame's routing is in its payload: any address selects it).
PyObject* step_calls_post(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long ubatch, layer;
  unsigned long long src, weights = 0, ids = 0;
  if (!PyArg_ParseTuple(args, "OkkK|KK", &capsule, &ubatch, &layer, &src, &weights, &ids))
    return nullptr;
  Calls* c = calls_of(capsule);
  if (c == nullptr) return nullptr;
  Frame* f = prepared(weights ? c->send_routed : c->send, ubatch);
  if (f == nullptr) {
    PyErr_SetString(PyExc_ValueError, "step call: micro-batch not prepared");
    return nullptr;
  }
  const int64_t t0 = afd_now_ns();
  const int status = c->lane != nullptr ? post<LaneEnd>(*c, *f, layer, src, weights, ids)
                                        : post<SocketEnd>(*c, *f, layer, src, weights, ids);
  c->send_ns += afd_now_ns() - t0;
  if (status == 0) ++c->calls;
  return PyLong_FromLong(status);
}

// step_calls_take(calls, ubatch, layer, dst) -> 1 (the frame of (ubatch,
// layer) came and was consumed, its payload copied (unpacked) to dst; a lane's
// left in its slot when dst is 0) | 2 (its routed frame: the routing stays in
// the slot or the codec's buffer) | 0 (not within the wait's bound, on a
// closed link or when another message came: left for the general path) |
// -errno (a socket's payload did not follow its header)
PyObject* step_calls_take(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long ubatch, layer;
  unsigned long long dst;
  if (!PyArg_ParseTuple(args, "OkkK", &capsule, &ubatch, &layer, &dst)) return nullptr;
  Calls* c = calls_of(capsule);
  if (c == nullptr) return nullptr;
  Frame* plain = prepared(c->recv, ubatch);
  Frame* routed = prepared(c->recv_routed, ubatch);
  if (plain == nullptr && routed == nullptr) {
    PyErr_SetString(PyExc_ValueError, "step call: micro-batch not prepared");
    return nullptr;
  }
  const int64_t t0 = afd_now_ns();
  const int status = c->lane != nullptr ? take<LaneEnd>(*c, plain, routed, layer, dst)
                                        : take<SocketEnd>(*c, plain, routed, layer, dst);
  c->wait_ns += afd_now_ns() - t0;
  return PyLong_FromLong(status);
}

// step_calls_times(calls) -> (send_ns, wait_ns, calls sent) so far
PyObject* step_calls_times(PyObject*, PyObject* args) {
  PyObject* capsule;
  if (!PyArg_ParseTuple(args, "O", &capsule)) return nullptr;
  Calls* c = calls_of(capsule);
  if (c == nullptr) return nullptr;
  return Py_BuildValue("(LLK)", static_cast<long long>(c->send_ns),
                       static_cast<long long>(c->wait_ns),
                       static_cast<unsigned long long>(c->calls));
}

}  // namespace afd_lane
