// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// A step's layer calls over a tcp connector's socket, prepared once per step:
// what lane_calls.cpp is for the shm lane. Through the connector's general
// path a layer call's message end is a dozen Python functions (checks, a
// LayerFrame built, encoded, decoded and checked, three receives, one
// sendmsg): ~95 us a round trip at 1 KiB on the 2-core VM, against ~18 us for
// the same frames sent and received by a bare Python loop. What is fixed for a
// step is fixed here once, per micro-batch and direction: the frame's bytes up
// to its payload (the connector's prefix and the LayerFrame template, patched
// with step and micro-batch; the layer is patched per call). Then
//
//   sock_post_call(prepared, ubatch, layer, src): patch the layer in, send
//                   prefix, header and the payload at src in one sendmsg
//   sock_take_call(prepared, ubatch, layer, dst): wait until the expected
//                   prefix and header are readable (peeked, not read), compare,
//                   consume them and receive the payload into dst
//
// The peek is what lets every surprise go the general way: a frame that is not
// the expected one (an ErrorFrame, a goodbye, anything malformed), a closed
// socket or a wait past its bound leaves the socket as it was, and the
// connector's general receive reads it and raises what it always did. Only a
// failure after the header was consumed (the peer gone or stalled mid-payload)
// or after part of a frame went out is reported here, as -errno: the stream
// can no longer be read or written frame by frame, and the connector fails.
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
constexpr int kMaxHeader = 512;  // tcp_fast.py's bound on prefix + header
const char* kSockCalls = "vllm_afd.sock_calls";

// One direction's frame of one micro-batch, up to its payload.
struct SockFrame {
  bool usable = false;
  uint8_t header[kMaxHeader];
  Py_ssize_t len = 0, layer_at = 0;
  uint64_t nbytes = 0;
  FrameCodec codec;  // fp8, routing: packed / received in its buffer (frame_codec.h)
};

struct SockCalls {
  PyObject* owner;  // the socket object: keeps the descriptor open
  int fd;
  int64_t spin_ns;      // how long a wait polls the socket before it sleeps in poll()
  int64_t fast_wait_ns; // how long a receive waits for its frame to begin at all
  int timeout_ms;       // how long a frame begun may take to finish, either way
  SockFrame send[kMaxUbatches], recv[kMaxUbatches];
  // The same micro-batches' frames with routing (gate_on "attention": MoE
  // layers' hidden states carry it, dense layers' do not), where prepared.
  SockFrame send_routed[kMaxUbatches], recv_routed[kMaxUbatches];
  int64_t send_ns = 0, wait_ns = 0;
  uint64_t calls = 0;
};

SockCalls* calls_of(PyObject* capsule) {
  return static_cast<SockCalls*>(PyCapsule_GetPointer(capsule, kSockCalls));
}

void free_calls(PyObject* capsule) {
  SockCalls* p = calls_of(capsule);
  if (p == nullptr) return;
  Py_XDECREF(p->owner);
  p->~SockCalls();
  free(p);
}

// frames: per micro-batch None or (template, step_at, layer_at, ubatch_at,
// nbytes[, codec spec]), the template being the frame's bytes up to its
// payload; the spec: FrameCodec::load's (its buffer: where the payload is
// packed before it is sent, received before it is unpacked).
bool load(PyObject* frames, SockFrame* out, unsigned long long step) {
  PyObject* seq = PySequence_Fast(frames, "sock_prepare: frames must be a sequence");
  if (seq == nullptr) return false;
  const Py_ssize_t n = PySequence_Size(seq);
  bool ok = n >= 0 && n <= kMaxUbatches;
  if (!ok && !PyErr_Occurred())
    PyErr_SetString(PyExc_ValueError, "sock_prepare: too many micro-batches");
  for (Py_ssize_t u = 0; ok && u < n; ++u) {
    PyObject* item = PySequence_GetItem(seq, u);
    if (item == nullptr) {
      ok = false;
      break;
    }
    if (item != Py_None) {
      Template t;
      unsigned long long nbytes;
      PyObject* spec = nullptr;
      SockFrame& f = out[u];
      ok = PyArg_ParseTuple(item, "O!nnnK|O", &PyBytes_Type, &t.bytes, &t.step_at, &t.layer_at,
                            &t.ubatch_at, &nbytes, &spec) &&
           t.load() && f.codec.load(spec, nbytes);
      if (ok && f.codec.packs && nbytes && f.codec.buffer == 0) {
        PyErr_SetString(PyExc_ValueError, "sock_prepare: a packed frame needs a buffer");
        ok = false;
      }
      if (ok && (t.len > kMaxHeader ||
                 !patch(t, f.header, step, 0, static_cast<unsigned long>(u)))) {
        PyErr_SetString(PyExc_ValueError, "sock_prepare: bad template");
        ok = false;
      }
      if (ok) {
        f.usable = true;
        f.len = t.len;
        f.layer_at = t.layer_at;
        f.nbytes = nbytes;
      }
    }
    Py_DECREF(item);
  }
  Py_DECREF(seq);
  return ok;
}

int wait_fd(int fd, short events, int64_t until_ns) {
  const int64_t left_ms = (until_ns - afd_now_ns() + 999999) / 1000000;
  pollfd pfd{fd, events, 0};
  return poll(&pfd, 1, left_ms > 0 ? static_cast<int>(left_ms < 1000 ? left_ms : 1000) : 0);
}

// Send frame f of layer with its payload at src (an fp8 or routed frame's
// packed from it and the routing at weights and ids into the frame's buffer
// first): 0 (sent), 1 (nothing sent: the socket's buffer is full or the
// socket failed; the general send takes over and says why) or -errno (part of
// the frame went out, the rest could not: the stream is broken).
int post(SockCalls* p, SockFrame& f, unsigned long layer, uint64_t src, uint64_t weights,
         uint64_t ids) {
  put_be(f.header + f.layer_at, layer, 4);
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
  const int64_t deadline = afd_now_ns() + static_cast<int64_t>(p->timeout_ms) * 1000000;
  while (true) {
    msghdr msg{};
    msg.msg_iov = iov + first;
    msg.msg_iovlen = count - first;
    const ssize_t n = sendmsg(p->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
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
    wait_fd(p->fd, POLLOUT, deadline);
  }
}

// Whether the n bytes seen so far can begin frame f (nullptr: none prepared).
bool may_be(const uint8_t* seen, size_t n, const SockFrame* f) {
  return f != nullptr && memcmp(seen, f->header, n < static_cast<size_t>(f->len) ? n : f->len) == 0;
}

// Wait for micro-batch u's frame of layer, the plain one or (where prepared,
// routed not nullptr) the routed one, and take it, its payload into dst (an
// fp8 or routed frame's received into the frame's buffer and its hidden
// states unpacked into dst, unless dst is 0 or the buffer itself): 1 (the
// plain frame taken), 2 (the routed one), 0 (not there within the wait's
// bound, or something else is: nothing read, the general receive takes over)
// or -errno (the header was read, the payload did not follow).
int take(SockCalls* p, SockFrame* plain, SockFrame* routed, unsigned long layer, uint64_t dst) {
  if (plain != nullptr) put_be(plain->header + plain->layer_at, layer, 4);
  if (routed != nullptr) put_be(routed->header + routed->layer_at, layer, 4);
  uint8_t seen[kMaxHeader];
  const int64_t start = afd_now_ns();
  const int64_t spin_end = start + p->spin_ns;
  const int64_t wait_end = start + (p->spin_ns > p->fast_wait_ns ? p->spin_ns : p->fast_wait_ns);
  // The two frames' prefixes differ (header and payload lengths), so the
  // bytes seen soon tell which one is coming.
  size_t want = 0;
  if (plain != nullptr) want = static_cast<size_t>(plain->len);
  if (routed != nullptr && static_cast<size_t>(routed->len) > want)
    want = static_cast<size_t>(routed->len);
  SockFrame* match = nullptr;
  while (true) {
    const ssize_t n = recv(p->fd, seen, want, MSG_PEEK | MSG_DONTWAIT);
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
      wait_fd(p->fd, POLLIN, wait_end);
  }
  SockFrame& f = *match;
  const size_t len = static_cast<size_t>(f.len);
  if (recv(p->fd, seen, len, MSG_DONTWAIT) != static_cast<ssize_t>(len)) return -EPROTO;
  uint8_t* to = reinterpret_cast<uint8_t*>(f.codec.packs ? f.codec.buffer : dst);
  uint64_t got = 0;
  const int64_t stall_end = afd_now_ns() + static_cast<int64_t>(p->timeout_ms) * 1000000;
  while (got < f.nbytes) {
    const ssize_t n = recv(p->fd, to + got, f.nbytes - got, MSG_DONTWAIT);
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
      wait_fd(p->fd, POLLIN, stall_end);
  }
  if (f.codec.packs && dst) f.codec.decode(to, reinterpret_cast<uint8_t*>(dst));
  return match == plain ? 1 : 2;
}

SockFrame* usable(SockFrame* frames, unsigned long u, bool quiet = false) {
  if (u >= static_cast<unsigned long>(kMaxUbatches) || !frames[u].usable) {
    if (!quiet) PyErr_SetString(PyExc_ValueError, "sock call: micro-batch not prepared");
    return nullptr;
  }
  return &frames[u];
}

}  // namespace

// sock_prepare(sock, fd, step, spin_ns, fast_wait_ms, timeout_ms, sends, recvs[,
// routed_sends, routed_recvs]) -> prepared. sends/recvs: per micro-batch None
// or (template, step_at, layer_at, ubatch_at, nbytes[, codec spec]); the routed
// ones the same frames with routing (None: none). sock (the socket object)
// stays referenced while the result lives.
PyObject* sock_prepare(PyObject*, PyObject* args) {
  PyObject *owner, *sends, *recvs, *routed_sends = Py_None, *routed_recvs = Py_None;
  int fd, fast_wait_ms, timeout_ms;
  unsigned long long step;
  long long spin_ns;
  if (!PyArg_ParseTuple(args, "OiKLiiOO|OO", &owner, &fd, &step, &spin_ns, &fast_wait_ms,
                        &timeout_ms, &sends, &recvs, &routed_sends, &routed_recvs))
    return nullptr;
  if (fd < 0) {
    PyErr_SetString(PyExc_ValueError, "sock_prepare: the socket is closed");
    return nullptr;
  }
  void* memory = malloc(sizeof(SockCalls));
  if (memory == nullptr) return PyErr_NoMemory();
  SockCalls* p = new (memory) SockCalls();
  p->owner = nullptr;
  if (!load(sends, p->send, step) || !load(recvs, p->recv, step) ||
      (routed_sends != Py_None && !load(routed_sends, p->send_routed, step)) ||
      (routed_recvs != Py_None && !load(routed_recvs, p->recv_routed, step))) {
    p->~SockCalls();
    free(memory);
    return nullptr;
  }
  p->fd = fd;
  p->spin_ns = spin_ns > 0 ? spin_ns : 0;
  p->fast_wait_ns = static_cast<int64_t>(fast_wait_ms) * 1000000;
  p->timeout_ms = timeout_ms;
  PyObject* result = PyCapsule_New(p, kSockCalls, free_calls);
  if (result == nullptr) {
    p->~SockCalls();
    free(memory);
    return nullptr;
  }
  Py_INCREF(owner);
  p->owner = owner;
  return result;
}

// sock_post_call(prepared, ubatch, layer, src[, weights, ids]) -> 0 (sent) | 1
// (nothing sent) | -errno (the frame went out in part: the stream is broken).
// With weights (not 0): the routed frame, its routing from weights and ids.
PyObject* sock_post_call(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long ubatch, layer;
  unsigned long long src, weights = 0, ids = 0;
  if (!PyArg_ParseTuple(args, "OkkK|KK", &capsule, &ubatch, &layer, &src, &weights, &ids))
    return nullptr;
  SockCalls* p = calls_of(capsule);
  SockFrame* f = p == nullptr ? nullptr : usable(weights ? p->send_routed : p->send, ubatch);
  if (f == nullptr) return nullptr;
  const int64_t t0 = afd_now_ns();
  int status;
  Py_BEGIN_ALLOW_THREADS status = post(p, *f, layer, src, weights, ids);
  Py_END_ALLOW_THREADS p->send_ns += afd_now_ns() - t0;
  if (status == 0) ++p->calls;
  return PyLong_FromLong(status);
}

// sock_take_call(prepared, ubatch, layer, dst) -> 1 (the frame of (ubatch,
// layer) came, its payload is in dst) | 2 (its routed frame, the payload in
// the frame's buffer, the hidden states in dst) | 0 (not within the wait's
// bound, or another message: nothing read) | -errno (the payload did not
// follow its header)
PyObject* sock_take_call(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long ubatch, layer;
  unsigned long long dst;
  if (!PyArg_ParseTuple(args, "OkkK", &capsule, &ubatch, &layer, &dst)) return nullptr;
  SockCalls* p = calls_of(capsule);
  if (p == nullptr) return nullptr;
  SockFrame* plain = usable(p->recv, ubatch, true);
  SockFrame* routed = usable(p->recv_routed, ubatch, true);
  if (plain == nullptr && routed == nullptr) {
    usable(p->recv, ubatch);  // raises "not prepared"
    return nullptr;
  }
  const int64_t t0 = afd_now_ns();
  int status;
  Py_BEGIN_ALLOW_THREADS status = take(p, plain, routed, layer, dst);
  Py_END_ALLOW_THREADS p->wait_ns += afd_now_ns() - t0;
  return PyLong_FromLong(status);
}

// sock_call_times(prepared) -> (send_ns, wait_ns, calls sent) so far
PyObject* sock_call_times(PyObject*, PyObject* args) {
  PyObject* capsule;
  if (!PyArg_ParseTuple(args, "O", &capsule)) return nullptr;
  SockCalls* p = calls_of(capsule);
  if (p == nullptr) return nullptr;
  return Py_BuildValue("(LLK)", static_cast<long long>(p->send_ns),
                       static_cast<long long>(p->wait_ns),
                       static_cast<unsigned long long>(p->calls));
}

}  // namespace afd_lane
