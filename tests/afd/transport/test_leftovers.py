# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""AFD's shared-memory names left by dead processes (vllm/afd/transport/leftovers.py):
removed when a server starts, by their creator's pid, never a live one's."""

import os
import subprocess

from helpers.connectors import free_port, make
from vllm.afd.transport import leftovers


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_only_names_of_dead_creators_go(tmp_path):
    dead, live = dead_pid(), os.getpid()
    names = {
        "dead-shm": f"vllm-afd-7700-0-a2f-{dead}x0a1b2c3d",
        "dead-ipc": f"vllm-afd-ipc-{dead}x0a1b2c3d",
        "live-shm": f"vllm-afd-7700-0-f2a-{live}x0a1b2c3d",
        "live-ipc": f"vllm-afd-ipc-{live}x0a1b2c3d",
        "init": "vllm-afd-ipc-1x0a1b2c3d",  # pid 1: alive (and maybe not ours)
        "not-afd": f"psm_{dead}x0a1b2c3d",
        "old-name": "vllm-afd-7700-0-a2f-0a1b2c3d",  # no pid: never guessed at
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    removed = leftovers.remove_dead(tmp_path)
    assert sorted(removed) == sorted([names["dead-shm"], names["dead-ipc"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n for k, n in names.items() if not k.startswith("dead"))


def test_names_made_now_carry_their_creator():
    name = leftovers.owned_name("vllm-afd-ipc-")
    assert leftovers._OWNED.match(name)["pid"] == str(os.getpid())


def test_an_ffn_listener_starting_removes_a_dead_process_s_segments():
    shm = leftovers.SHM_DIR
    left = shm / f"vllm-afd-{free_port()}-0-a2f-{dead_pid()}x0a1b2c3d"
    left.write_bytes(b"x" * 4096)
    ffn = make("shm", "ffn", free_port())
    try:
        ffn.listen()
        assert not left.exists()
    finally:
        ffn.close()
        left.unlink(missing_ok=True)
