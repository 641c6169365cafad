# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A local, one-node Ray cluster for tests: `ray start --head --block` in its
own session and temporary directory, stopped (every Ray process of it) on exit.

Ray picks the host's primary address for its node (it does not accept
127.0.0.1 for a head); nothing else joins, so the cluster is this host only.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servers import free_port


def ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


class RayHead:
    def __init__(self, num_cpus: int = 16, log_path: Path | None = None) -> None:
        self.num_cpus = num_cpus
        self.port = free_port()
        # Ray's unix sockets live under the temp dir: keep the path short.
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.log_path = Path(log_path or Path(self.temp_dir) / "head.log")
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self, timeout: float = 60.0) -> RayHead:
        log = open(self.log_path, "wb")
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(
            [ray_bin(), "start", "--head", "--block", f"--port={self.port}",
             f"--num-cpus={self.num_cpus}", "--num-gpus=0", "--include-dashboard=false",
             "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
             # Ray's default worker ports (10002-19999) and client port (10001)
             # are where free_port() hands out test ports: random ones instead.
             "--min-worker-port=0", "--max-worker-port=0",
             f"--ray-client-server-port={free_port()}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            text = self.log_path.read_text(errors="replace")
            if "Ray runtime started" in text:
                for line in text.splitlines():
                    if "ray start --address=" in line:
                        self.address = line.split("--address=")[1].strip().strip("'\"")
                if self.address:
                    return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"ray head not up after {timeout:.0f}s:\n"
                           f"{self.log_path.read_text(errors='replace')[-3000:]}")

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the head and every process it started (raylet, GCS, workers)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> RayHead:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
