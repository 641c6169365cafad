# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""tools/serving/servers.py free_port(): two live processes never hand out one port.

Each process walks the range below the kernel's ephemeral ports from a start
spread by pid; the suite's two workers and their subprocesses meet there (a
fresh-clone run gave an FFN server's link the port another worker had just
given an API server, and the batch-queue probe hung). A port handed out is held
by a lock on a file of its own until its process ends."""

import subprocess
import sys

import servers

NEXT = ("import sys; sys.path.insert(0, {tools!r}); import servers; "
        "servers._next_port.append({start}); print(servers.free_port())")


def _free_port_in_another_process(start: int) -> int:
    code = NEXT.format(tools=str(servers.Path(servers.__file__).parent), start=start)
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout)


def test_a_port_this_process_holds_is_skipped_by_another():
    held = servers.free_port()
    other = _free_port_in_another_process(held)
    assert other != held and other % servers.PORT_STRIDE == held % servers.PORT_STRIDE
    # The other process has ended: its port is free for the next one.
    assert _free_port_in_another_process(other) == other
