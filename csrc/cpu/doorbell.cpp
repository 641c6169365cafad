// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
//
// The shm connector's doorbell: how one process tells another, on the same
// host, that a message is in shared memory (vllm/afd/transport/shm_ring.py).
//
// A sender publishes a 32-bit sequence word with a release store; a receiver
// spins on it (acquire loads) for a bounded time, then sleeps in poll() on
// the connection's socket after raising its `sleeping` flag. The sender
// writes one wake byte on the socket only when that flag is up, so a busy
// link costs no system call at all, and an idle one costs no CPU.
//
// Lost wake-ups are impossible: the receiver stores `sleeping` and then loads
// the word, the sender stores the word and then loads `sleeping`, all
// sequentially consistent (Dekker): at least one of them sees the other's
// store. Sleeping on the socket, not a futex, keeps peer death visible: a
// dead or closed peer is EOF/hang-up on the very descriptor we sleep on.
//
// Plain C functions, called by the shm message lane (lane.cpp), which keeps
// the counters and releases the GIL around a wait.
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>

#include "spin.h"

#ifndef POLLRDHUP
#define POLLRDHUP 0
#endif

namespace {

// 64 spin iterations take well under a microsecond. A gap of this much means
// the spinner lost its core for a scheduler time slice (milliseconds), not
// for an interrupt or a short-lived thread of its own process.
constexpr int64_t kPreemptedNs = 500000;

// This thread's involuntary context switches so far: the times the kernel
// took its core for another runnable thread (-1 where unknown).
int64_t involuntary_switches() {
#ifdef RUSAGE_THREAD
  rusage usage;
  if (getrusage(RUSAGE_THREAD, &usage) == 0) return usage.ru_nivcsw;
#endif
  return -1;
}

// Whether a gap in a spin was the kernel giving the core to another thread:
// an involuntary context switch since `before` (or `before` unknown: -1).
bool lost_core(int64_t before) {
  return before < 0 || involuntary_switches() != before;
}

bool changed(const uint32_t* word, uint32_t seen) {
  return __atomic_load_n(word, __ATOMIC_SEQ_CST) != seen;
}

// Read and drop pending wake bytes; false once the peer closed (EOF) or the
// socket failed.
bool drain(int fd) {
  char buf[64];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) continue;
    if (n == 0) return false;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK;
  }
}

}  // namespace

extern "C" {

// Wait until *word != seen. Spin for up to spin_ns (or until the spinning
// thread is preempted: the core is wanted by another thread), then sleep on fd
// for up to timeout_ms in all. Returns 1 when the word changed (2: and the
// spin was cut short by a preemption), 0 on timeout,
// -1 when fd reports the peer gone (EOF, hang-up, error) or *abort is set
// (this side closes the link; it shuts the socket down too, which ends a poll).
int afd_doorbell_wait(const uint32_t* word, uint32_t* sleeping, uint32_t seen, int fd,
                      int64_t spin_ns, int timeout_ms, const uint32_t* abort) {
  if (changed(word, seen)) return 1;
  const int64_t start = afd_now_ns();
  bool preempted = false;
  if (spin_ns > 0) {
    int64_t last = start;
    // Read at the first check, not before the first look at the word: the
    // system call would delay an answer that is already on its way.
    int64_t switches = -1;
    for (uint32_t i = 1;; ++i) {
      afd_cpu_relax();
      if (changed(word, seen))
        return afd_now_ns() - last > kPreemptedNs && lost_core(switches) ? 2 : 1;
      if ((i & 63) == 0) {
        if (__atomic_load_n(abort, __ATOMIC_RELAXED)) return -1;
        const int64_t t = afd_now_ns();
        if (t - last > kPreemptedNs) {
          // Spinning pays only on a core of our own. A gap between two checks
          // can mean the scheduler gave the core to another thread (more
          // runnable threads than cores): a preempted spinner waits a whole
          // time slice to run again where a sleeper would be woken at once,
          // so sleep, and tell the caller (2), who stops spinning when that
          // happens often. A gap without an involuntary context switch is not
          // that: the hypervisor ran another guest on this vCPU, or an
          // interrupt took the time (a VM's usual noise). Sleeping helps no
          // one then; keep spinning.
          if (lost_core(switches)) {
            preempted = true;
            break;
          }
        } else if (i == 64) {
          switches = involuntary_switches();
        }
        if (t - start >= spin_ns) break;
        last = t;
      }
    }
  }
  const int64_t deadline = start + static_cast<int64_t>(timeout_ms) * 1000000;
  for (;;) {
    __atomic_store_n(sleeping, 1u, __ATOMIC_SEQ_CST);
    if (changed(word, seen)) {
      __atomic_store_n(sleeping, 0u, __ATOMIC_SEQ_CST);
      return preempted ? 2 : 1;
    }
    if (__atomic_load_n(abort, __ATOMIC_SEQ_CST)) {
      __atomic_store_n(sleeping, 0u, __ATOMIC_SEQ_CST);
      return -1;
    }
    const int64_t left_ns = deadline - afd_now_ns();
    pollfd p = {fd, static_cast<short>(POLLIN | POLLRDHUP), 0};
    int r = left_ns > 0 ? poll(&p, 1, static_cast<int>((left_ns + 999999) / 1000000)) : 0;
    __atomic_store_n(sleeping, 0u, __ATOMIC_SEQ_CST);
    // A message the peer published before it went away is still delivered.
    if (changed(word, seen)) return preempted ? 2 : 1;
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (r == 0) return 0;
    if (p.revents & POLLIN) {
      if (!drain(fd)) return -1;
    } else if (p.revents & (POLLHUP | POLLERR | POLLNVAL | POLLRDHUP)) {
      return -1;
    }
  }
}

// Publish value in *word (release: everything this thread wrote before, the
// message and its payload, is visible to whoever sees value); wake the peer
// if it sleeps. Returns 0, or -errno when the wake byte cannot be sent (the
// peer is gone).
int afd_doorbell_ring(uint32_t* word, const uint32_t* sleeping, uint32_t value, int fd) {
  __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
  if (fd < 0 || __atomic_load_n(sleeping, __ATOMIC_SEQ_CST) == 0) return 0;
  const char wake = 1;
  for (;;) {
    ssize_t n = send(fd, &wake, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n == 1) return 0;
    if (n < 0 && errno == EINTR) continue;
    // A full socket buffer already holds wake bytes the peer has yet to read.
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    return n < 0 ? -errno : -EPIPE;
  }
}

}  // extern "C"
