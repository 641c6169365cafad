# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A device the CPU stands in for: DeviceOps whose copies land late, as on an
asynchronous accelerator."""

import time
from concurrent.futures import ThreadPoolExecutor

from vllm.afd.transport.device import DeviceOps


class DeferredOps(DeviceOps):
    """A fake device: copies land `delay` seconds later on a worker thread and
    read their source only then (as a DMA does); an event is the copy's
    future. Stands in for a GPU, which cannot exist here."""

    def __init__(self, delay: float = 0.2) -> None:
        super().__init__("cpu")
        self.delay = delay
        self.pool = ThreadPoolExecutor(1)
        self.writes = ThreadPoolExecutor(1)
        self.last = None

    def copy(self, dst, src) -> None:
        def later():
            time.sleep(self.delay)
            dst.copy_(src)

        self.last = self.pool.submit(later)

    def copy_to_host(self, dst, src) -> None:
        """Blocking: returns once the copy landed. On a worker of its own (as
        if on another stream) and without the receives' delay: waiting for
        the receives' copies before it, it would settle their slots itself and
        the slot rules' negative controls (a no-op release) could not fail."""
        self.landing(dst, src).result()

    def landing(self, dst, src, delay: float = 0.0):
        def later():
            time.sleep(delay)
            dst.copy_(src)

        return self.writes.submit(later)

    def record(self, event=None):
        return self.last

    def wait_host(self, event) -> None:
        if event is not None:
            event.result()

    def wait_stream(self, event) -> None:
        self.wait_host(event)

    def wait_host_settled(self, event) -> None:  # a future has no query(): wait
        self.wait_host(event)
