# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""tools/models/oracle.py --matrix runs each engine in a forked child (`in_child`): its
result comes back as JSON, a failure as the child's traceback, a child killed
or stuck as an error naming it, and never does a child return into the
parent's loop. The matrices themselves are test_families*.py's."""

import json
import os
import signal
import sys
import time

import oracle


def test_a_run_returns_its_result_and_what_it_imported(tmp_path):
    def run():  # colorsys: a module the parent has not imported
        return {"pid": os.getpid(), "tokens": [1, 2, 3], "module": __import__("colorsys").__name__}

    sys.modules.pop("colorsys", None)
    ok, imported = oracle.in_child(run, tmp_path / "a.json", tmp_path / "a.error.txt")
    assert ok and "colorsys" in imported and "colorsys" not in sys.modules
    result = json.loads((tmp_path / "a.json").read_text())
    assert result["tokens"] == [1, 2, 3] and result["pid"] != os.getpid()
    assert not (tmp_path / "a.error.txt").exists()


def test_a_failed_run_leaves_its_traceback_and_the_parent_goes_on(tmp_path):
    def run():
        raise RuntimeError("engine refused the checkpoint")

    ok, _ = oracle.in_child(run, tmp_path / "b.json", tmp_path / "b.error.txt")
    assert not ok and not (tmp_path / "b.json").exists()
    text = (tmp_path / "b.error.txt").read_text()
    assert "Traceback" in text and "RuntimeError: engine refused the checkpoint" in text


def test_a_killed_run_is_named_by_its_signal(tmp_path):
    ok, _ = oracle.in_child(lambda: os.kill(os.getpid(), signal.SIGKILL),
                            tmp_path / "c.json", tmp_path / "c.error.txt")
    assert not ok
    assert (tmp_path / "c.error.txt").read_text() == (
        "the run's process died of signal 9 (writing c.json)\n")


def test_a_stuck_run_is_killed_at_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(oracle, "RUN_TIMEOUT_S", 1)
    t0 = time.monotonic()
    ok, _ = oracle.in_child(lambda: time.sleep(60), tmp_path / "d.json",
                            tmp_path / "d.error.txt")
    assert not ok and time.monotonic() - t0 < 10
    assert (tmp_path / "d.error.txt").read_text() == (
        "the run did not end in 1 s (writing d.json)\n")
