# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention link's published state (attention/status.py, read by the API
server's /health and /afd/status) and when it is written: its periodic
publish never runs inside a step, where on the attention's core it would
preempt the model thread's spin for the FFN's answer; the step's end writes
it instead. Real link and FFN loop over tcp, in threads of one process."""

import json
import time

import pytest
import torch

from vllm.afd.attention import link as link_module
from vllm.afd.attention import status as link_status
from vllm.afd.attention.link import AttentionLink, ForwardPass
from vllm.afd.ffn.loop import FFNLoop
from vllm.afd.topology import FFNPlacement
from vllm.afd.transport.config import LinkConfig
from helpers.connectors import HIDDEN, free_port


@pytest.fixture
def served_link(monkeypatch):
    """(link, publishes): publishes records (in a step?, steps counted) per
    document written."""
    monkeypatch.setattr(link_module, "PUBLISH_INTERVAL_S", 0.02)
    publishes = []
    holder = {}
    real = link_status.publish

    def record(name, document):
        if name.startswith("link-"):
            publishes.append((holder["link"].forward_pass is not None, document["steps"]))
        real(name, document)

    monkeypatch.setattr(link_status, "publish", record)
    port = free_port()
    config = dict(connector="tcp", port=port, timeout_s=10)
    loop = FFNLoop(LinkConfig(role="ffn", **config), layers=[0, 1],
                   compute=lambda layer, h, routing: h + layer, hidden_size=HIDDEN,
                   dtype=torch.float32, max_tokens=8, placement=FFNPlacement(rank=0, group=[0]),
                   warmup_sizes=[])
    loop.start()
    link = holder["link"] = AttentionLink(LinkConfig(**config), hidden_size=HIDDEN,
                                          dtype=torch.float32, max_tokens=8)
    link.add_layer(0)
    link.add_layer(1)
    try:
        assert loop.ready.wait(10)
        yield link, publishes
    finally:
        link.close()
        loop.stop()


def one_step(link, hold_s: float) -> None:
    link.begin_step(ForwardPass(num_tokens=(2,)))
    time.sleep(hold_s)  # the periodic publish comes due several times meanwhile
    h = torch.randn(2, HIDDEN)
    for layer in (0, 1):
        assert torch.equal(link.exchange(layer, h, torch.empty_like(h)), h + layer)
    link.end_step()


def test_the_periodic_publish_waits_for_the_end_of_the_step(served_link, tmp_path,
                                                            monkeypatch):
    monkeypatch.setenv(link_status.ENV_STATUS_DIR, str(tmp_path))
    link, publishes = served_link
    link.start()
    deadline = time.monotonic() + 10
    while not (link.state == link_status.READY and len(publishes) >= 3):
        assert time.monotonic() < deadline, (link.state, publishes)
        time.sleep(0.01)
    del publishes[:]
    one_step(link, 0.3)
    assert publishes and publishes[0] == (False, 1), publishes  # written by end_step
    assert not any(in_step for in_step, _ in publishes), publishes
    document = json.loads((tmp_path / "link-a0.json").read_text())
    assert document["steps"] == 1 and document["state"] == link_status.READY


def test_without_a_status_directory_nothing_is_built(served_link, monkeypatch):
    monkeypatch.delenv(link_status.ENV_STATUS_DIR, raising=False)
    link, publishes = served_link
    link.start()
    one_step(link, 0.1)
    time.sleep(0.1)
    assert publishes == []


def test_a_killed_servers_status_directory_is_removed_by_the_next(tmp_path, monkeypatch):
    """SIGKILL leaves an API server's status directory behind (atexit never
    runs); the next attention server removes it, and leaves a live one's."""
    import os
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gone = tmp_path / f"{link_status.PREFIX}{dead.pid}-abc"
        reused = tmp_path / f"{link_status.PREFIX}{os.getpid()}-def"  # our pid, earlier owner
        kept = tmp_path / f"{link_status.PREFIX}{alive.pid}-ghi"
        for d in (gone, reused, kept):
            d.mkdir()
            (d / "link-a0.json").write_text("{}")
        link_status.remove_orphans(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == [kept.name]
    finally:
        alive.kill()
        alive.wait()
