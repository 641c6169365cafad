# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""`vllm-afd launch`: specs, plans, and real deployments on a local Ray cluster.

Bad specs fail before anything starts, naming the field. Deployments (1A:1F on
shm, DeepSeek-V2 with its FFN worker on vLLM's Ray executor; 2A:1F Qwen3-MoE on
tcp with the secret from the launcher's environment, handed to the servers
through Ray) answer the openai client with plain vLLM's tokens and logprobs
through the printed endpoints (the FFN server its own small surface); Ctrl-C leaves no server process, actor,
placement group or shared-memory entry; a server killed by SIGKILL is reported
by name and reason, and the launcher tears the rest down.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import yaml

import preload
from servers import cpu, free_port, http_get, status_dirs_left
from oracle import engine_cli_args

from vllm.afd.deploy.launch import spec as spec_file
from vllm.afd.deploy.launch.plan import Node, describe, make_plan
from helpers.oracle import plain_result

MODEL = "tiny-qwen3-moe"
# MLA attention is not batch-invariant, and a served engine may start its first
# step before all prompts arrived: DeepSeek is compared on one prompt when served
# (its 10-prompt comparison is the oracle's, in one process).
MLA_MODEL = "tiny-deepseek-v2"
COMMON = ["--max-model-len", "512", "--dtype", "float32", "--enforce-eager",
          "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
          "--no-enable-prefix-caching"]
MAX_TOKENS = 16
# The launcher reports a dead server within REPORT_BOUND_S of its death (it
# waits on every server's exit with ray.wait, polling every 0.5 s) and has
# stopped the rest within TEARDOWN_BOUND_S (SIGTERM, SIGKILL after 20 s).
REPORT_BOUND_S = 5.0
TEARDOWN_BOUND_S = 40.0


def base_spec(models_dir: Path, model: str = MODEL, **changes) -> dict:
    spec = {
        "model": str(models_dir / model),
        "name": f"t{os.getpid()}-{free_port()}",
        "connector": "shm",
        "afd_port": free_port(),
        "args": [*COMMON, *engine_cli_args(models_dir / model)],
        "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
        "attention": {"http_port": free_port(), "resources": {"CPU": 1},
                      "env": {"VLLM_CPU_OMP_THREADS_BIND": cpu(0)}},
        "ffn": {"http_port": free_port(), "resources": {"CPU": 1},
                "env": {"VLLM_CPU_OMP_THREADS_BIND": cpu(1)}},
    }
    return merged(spec, changes)


def merged(spec: dict, changes: dict) -> dict:
    spec = dict(spec)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


# ------------------------------------------------------------------ the spec
@pytest.mark.parametrize("change, message", [
    ({"atention": {}}, "atention: unknown key"),
    ({"attention": {"serverz": 2}}, "attention.serverz: unknown key"),
    ({"attention": {"servers": 0}}, "attention.servers: must be >= 1, got 0"),
    ({"ffn": {"servers": 0}}, "ffn.servers: must be >= 1, got 0"),
    ({"ffn": {"tensor_parallel_size": 0}}, "ffn.tensor_parallel_size: must be >= 1"),
    ({"model": None}, "model: Input should be a valid string"),
    ({"ffn": {"http_port": "ATTN"}}, "ffn.http_port: port"),  # replaced below
    ({"afd_port": "ATTN"}, "afd_port: port"),
    ({"connector": "tcp"}, "secret: connector 'tcp' links servers over the network"),
    ({"connector": "tcp", "secret": {"env": "VLLM_AFD_TEST_UNSET"}},
     "secret.env: VLLM_AFD_TEST_UNSET is not set"),
    ({"secret": {"env": "A", "file": "/x"}}, "secret: Value error, give exactly one"),
    ({"placement": "spread"}, "placement: 'spread' puts servers on several nodes, but "
                              "connector 'shm' needs them all on one"),
    ({"args": ["--port", "9"]}, "args: --port is set by the launcher"),
    ({"ffn": {"args": ["--tensor-parallel-size=2"]}},
     "ffn.args: --tensor-parallel-size is set by the launcher"),
    ({"afd_config": {"port": 1}}, "afd_config.port: set by the launcher"),
    ({"num_ubatches": 5}, "num_ubatches: 5 is not in 1-4"),
    ({"ffn": {"executor": "slurm"}}, "ffn.executor: Input should be 'mp' or 'ray'"),
])
def test_bad_specs_name_the_field(models_dir, change, message):
    spec = base_spec(models_dir)
    attention_port, ffn_port = spec["attention"]["http_port"], spec["ffn"]["http_port"]
    if change.get("ffn", {}).get("http_port") == "ATTN":  # a clash with attention-0
        change = {"ffn": {"http_port": attention_port}}
        message = (f"ffn.http_port: port {attention_port} (ffn-0's HTTP port) is also "
                   f"attention-0's HTTP port")
    if change.get("afd_port") == "ATTN":  # a clash with ffn-0's HTTP port
        change = {"afd_port": ffn_port}
        message = (f"afd_port: port {ffn_port} (FFN rank 0's link port) is also ffn-0's "
                   f"HTTP port")
    with pytest.raises(spec_file.SpecError) as e:
        spec_file.parse(merged(spec, change))
    assert message in str(e.value)


def test_the_command_refuses_a_bad_spec_before_starting(models_dir, tmp_path, capsys):
    # No Ray cluster answers at 127.0.0.1:1: the spec is refused before any connection.
    from vllm.afd.deploy.commands import main

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(base_spec(models_dir, attention={"servers": 0})))
    assert main(["launch", str(path), "--address", "127.0.0.1:1"]) == 2
    assert "attention.servers: must be >= 1, got 0" in capsys.readouterr().err
    path.write_text("model: [unclosed")
    assert main(["launch", str(path), "--address", "127.0.0.1:1"]) == 2
    assert "not valid YAML or JSON" in capsys.readouterr().err


NODES = [Node("n1", "10.0.0.1", {"CPU": 4.0, "GPU": 2.0, "node:10.0.0.1": 1.0}),
         Node("n2", "10.0.0.2", {"CPU": 4.0, "GPU": 2.0, "node:10.0.0.2": 1.0})]


def test_plan_places_ranks_ports_and_hosts(models_dir, monkeypatch):
    monkeypatch.setenv("VLLM_AFD_TEST_SECRET", "s" * 32)
    spec = spec_file.parse(base_spec(
        models_dir, connector="tcp", placement="spread", afd_port=7700,
        secret={"env": "VLLM_AFD_TEST_SECRET"}, num_ubatches=2,
        attention={"servers": 2, "http_port": 8000, "resources": {"GPU": 1}},
        ffn={"servers": 2, "http_port": 8100, "resources": {"GPU": 1}}))
    plans = {p.name: p for p in make_plan(spec, NODES)}
    assert list(plans) == ["ffn-0", "ffn-1", "attention-0", "attention-1"]
    assert [plans[n].node.ip for n in plans] == ["10.0.0.1", "10.0.0.2", "10.0.0.1",
                                                "10.0.0.2"]
    assert plans["ffn-1"].bundle == {"GPU": 1, "node:10.0.0.2": 0.001}
    a1 = plans["attention-1"].afd_config
    assert (a1["role"], a1["attention_rank"], a1["num_attention_ranks"], a1["num_ffn_ranks"],
            a1["ffn_hosts"], a1["port"], a1["num_ubatches"]) == (
        "attention", 1, 2, 2, ["10.0.0.1", "10.0.0.2"], 7700, 2)
    f1 = plans["ffn-1"]
    assert f1.afd_config["ffn_rank"] == 1 and f1.http_port == 8101
    assert f1.argv[f1.argv.index("--afd-config") + 1] == json.dumps(f1.afd_config,
                                                                    sort_keys=True)
    text = describe(spec, list(plans.values()))
    assert "s" * 32 not in text and "from $VLLM_AFD_TEST_SECRET" in text
    rows = [line.split() for line in text.splitlines()]
    assert ["ffn-1", "10.0.0.2", "{GPU:", "1}", "8101", "7701", "ffn", "1"] in rows

    # pack: both FFN workers of a TP=2 server on one node; then what is left.
    spec = spec_file.parse(base_spec(
        models_dir, connector="tcp", secret={"env": "VLLM_AFD_TEST_SECRET"},
        attention={"http_port": 8000, "resources": {"GPU": 1}},
        ffn={"http_port": 8100, "tensor_parallel_size": 2, "expert_parallel": True,
             "resources": {"GPU": 1}}))
    plans = {p.name: p for p in make_plan(spec, NODES)}
    assert plans["ffn-0"].bundle == {"GPU": 2, "node:10.0.0.1": 0.001}
    assert plans["attention-0"].node.ip == "10.0.0.2"  # n1's GPUs are taken
    assert plans["attention-0"].afd_config["host"] == "10.0.0.1"
    argv = plans["ffn-0"].argv
    start = argv.index("--tensor-parallel-size")
    assert argv[start:start + 4] == ["--tensor-parallel-size", "2",
                                     "--enable-expert-parallel", COMMON[0]]

    spec = spec_file.parse(base_spec(models_dir, attention={"resources": {"GPU": 3}}))
    with pytest.raises(spec_file.SpecError, match=r"attention.resources: attention-0 needs "
                                                  r"\{GPU: 3\} on one node"):
        make_plan(spec, NODES)


# ------------------------------------------------------------ on local Ray
class Launch:
    """`python -m vllm.afd.deploy.launch SPEC` with its output read line by line."""

    def __init__(self, spec: dict, tmp_path: Path, address: str, env: dict | None = None):
        self.path = tmp_path / f"{spec['name']}.yaml"
        self.path.write_text(yaml.safe_dump(spec))
        self.lines: list[tuple[float, str]] = []
        self._queue: queue.Queue = queue.Queue()
        self.proc = preload.popen(
            [sys.executable, "-m", "vllm.afd.deploy.launch", str(self.path), "--address", address,
             "--log-dir", str(tmp_path / "logs")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, **(env or {})), start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
        self.lines.append((time.monotonic(), "<eof>"))

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, needle: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if needle in line:
                    return t
            if self.proc.poll() is not None and self.lines and self.lines[-1][1] == "<eof>":
                break
            time.sleep(0.2)
        raise AssertionError(f"no {needle!r} in the launcher's output:\n{self.text[-6000:]}")

    def servers(self) -> dict[str, dict]:
        """name -> url, pid, log, from the lines printed once ready."""
        found = {}
        for _, line in self.lines:
            parts = line.split()
            if len(parts) >= 7 and parts[0].startswith(("attention-", "ffn-")) and \
                    parts[1].startswith("http://") and parts[2] == "pid":
                found[parts[0]] = {"url": parts[1].rsplit("/", 2)[0] if parts[1].endswith(
                    "/afd/status") else parts[1].rsplit("/", 1)[0], "pid": int(parts[3]),
                    "log": parts[-1]}
        return found

    def stop(self, sig=signal.SIGINT, timeout: float = TEARDOWN_BOUND_S) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


def ray_state(address: str, names: list[str]) -> dict:
    """Which of the deployment's named actors and placement groups Ray still has."""
    code = f"""
import json, ray
ray.init(address={address!r}, namespace="vllm-afd", logging_level="ERROR", log_to_driver=False)
alive = []
for name in {names!r}:
    try:
        ray.get_actor(name, namespace="vllm-afd"); alive.append(name)
    except ValueError:
        pass
groups = [g["name"] for g in ray.util.placement_group_table().values()
          if g["state"] != "REMOVED" and g["name"].startswith("vllm-afd/")]
print(json.dumps({{"actors": alive, "groups": groups}}))
"""
    out = preload.run([sys.executable, "-c", code], capture_output=True, text=True,
                      timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie not yet reaped by init is dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def check_tokens(url: str, plain: dict, model: Path) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    comp = client.completions.create(
        model=str(model), prompt=[r["prompt"] for r in plain["results"]],
        max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert len(comp.choices) == len(plain["results"])
    for ref, got in zip(plain["results"], sorted(comp.choices, key=lambda c: c.index)):
        assert got.token_ids == ref["token_ids"], ref["prompt"]
        diff = max(abs(a - b) for a, b in zip(got.logprobs.token_logprobs, ref["logprobs"]))
        assert diff <= 1e-5, (ref["prompt"], diff)


def check_nothing_left(head, spec: dict, servers: dict[str, dict], since: float) -> None:
    """Nothing of the launch is left: actors, placement groups, server
    processes, shared memory (status directories made since `since`; an older
    one with a server's pid was an earlier process's)."""
    names = [f"{spec['name']}/{n}" for n in servers]
    deadline = time.monotonic() + 10
    while True:  # the actors' processes exit asynchronously after ray.kill
        state = ray_state(head.address, names)
        left = [n for n, s in servers.items() if alive(s["pid"])]
        shm = sorted(p.name for p in Path("/dev/shm").glob("vllm-afd-*")
                     if p.name.startswith((f"vllm-afd-{spec['afd_port']}-",
                                           f"vllm-afd-token-{spec['name']}"))) + [
            n for s in servers.values() for n in status_dirs_left(s["pid"], since)]
        if not (state["actors"] or state["groups"] or left or shm):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: {state}, server processes {left}, "
                                 f"shared memory {shm}")
        time.sleep(0.5)


def test_dry_run_prints_the_plan_and_starts_nothing(models_dir, tmp_path, ray_head):
    spec = base_spec(models_dir, attention={"servers": 2})
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    proc = preload.run([sys.executable, "-m", "vllm.afd.deploy.launch", str(path), "--address",
                        ray_head.address, "--dry-run"], capture_output=True, text=True,
                       timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    node = ray_head.address.split(":")[0]
    assert ["attention-1", node, "{CPU:", "1}", str(spec["attention"]["http_port"] + 1), "-",
            "attention", "1"] in rows, proc.stdout
    assert ["ffn-0", node, "{CPU:", "1}", str(spec["ffn"]["http_port"]),
            str(spec["afd_port"]), "ffn", "0"] in rows, proc.stdout
    assert "dry run: nothing started" in proc.stdout
    assert ray_state(ray_head.address, [f"{spec['name']}/ffn-0"]) == {"actors": [],
                                                                      "groups": []}


@pytest.mark.slow
def test_launch_1a1f_serves_and_ctrl_c_leaves_nothing(models_dir, tmp_path, ray_head):
    """DeepSeek-V2 (MLA), its FFN server's worker on vLLM's Ray executor (the
    spec's `executor: ray`): the server joins the launcher's cluster."""
    model = models_dir / MLA_MODEL
    spec = base_spec(models_dir, MLA_MODEL, ffn={"executor": "ray"})
    started = time.time()
    launch = Launch(spec, tmp_path, ray_head.address)
    # Plain vLLM's answer, computed while the servers start.
    plain = concurrent.futures.ThreadPoolExecutor(1).submit(plain_result, model, tmp_path,
                                                            num_prompts=1)
    try:
        launch.wait_for("ready in", timeout=300)
        servers = launch.servers()
        assert set(servers) == {"attention-0", "ffn-0"}, launch.text
        plain = plain.result(timeout=300)
        check_tokens(servers["attention-0"]["url"], plain, model)
        # The FFN's worker is a Ray actor of this cluster, not a child process.
        status = json.loads(http_get(servers["ffn-0"]["url"] + "/afd/status")[1])
        worker = status["workers"][0]["link"]["pid"]
        title = Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")[0]
        assert title.startswith(b"ray::RayWorkerProc"), (worker, title)
        # The FFN server: its own small surface, no OpenAI API.
        ffn = servers["ffn-0"]["url"]
        assert http_get(ffn + "/health")[0] == 200
        assert json.loads(http_get(ffn + "/version")[1])["role"] == "ffn"
        assert http_get(ffn + "/metrics")[0] == 200
        with pytest.raises(openai.NotFoundError, match="This is a vllm-afd FFN server"):
            openai.OpenAI(base_url=ffn + "/v1", api_key="x").completions.create(
                model=str(model), prompt="hi", max_tokens=4)
        chat = openai.OpenAI(base_url=servers["attention-0"]["url"] + "/v1",
                             api_key="x").chat.completions.create(
            model=str(model), messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=8, temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop")
        assert launch.stop(signal.SIGINT) == 0, launch.text
    finally:
        launch.stop(signal.SIGKILL)
    assert "stopping: SIGINT" in launch.text
    # Both servers shut down cleanly on the actors' SIGTERM.
    assert "  attention-0 exited with status 0" in launch.text, launch.text
    assert "  ffn-0 exited with status 0" in launch.text, launch.text
    assert "stopped 2 server(s)" in launch.text
    check_nothing_left(ray_head, spec, servers, started)


def assert_secret_demanded(attention_pid: int) -> None:
    """The FFN that attention server `attention_pid` links to refuses a peer with
    that server's AFD configuration but without its secret, at authentication."""
    import torch

    from vllm.afd.adapter.config import AFDConfig
    from vllm.afd.transport.connectors import ProtocolError, create_connector

    argv = Path(f"/proc/{attention_pid}/cmdline").read_bytes().decode().split("\0")
    config = json.loads(argv[argv.index("--afd-config") + 1])
    assert config.pop("token_file")
    bare = create_connector(AFDConfig(**{**config, "role": "attention", "timeout_s": 10}),
                            hidden_size=64, dtype=torch.float32, max_tokens=16)
    try:
        with pytest.raises(ProtocolError, match="authentication: this FFN server requires "
                                                "a secret and the attention server has none"):
            bare.connect()
    finally:
        bare.close()


@pytest.mark.slow
def test_launch_2a1f_secret_through_ray_and_a_killed_server(models_dir, tmp_path, ray_head):
    model = models_dir / MODEL
    secret = "launch-secret-" + "k" * 24
    spec = base_spec(models_dir, connector="tcp", attention={"servers": 2},
                     secret={"env": "VLLM_AFD_TEST_LAUNCH_TOKEN"})
    # Only the launcher has the secret; the Ray cluster was started without it.
    started = time.time()
    launch = Launch(spec, tmp_path, ray_head.address,
                    env={"VLLM_AFD_TEST_LAUNCH_TOKEN": secret})
    plain = concurrent.futures.ThreadPoolExecutor(1).submit(plain_result, model, tmp_path)
    try:
        launch.wait_for("ready in", timeout=400)
        servers = launch.servers()
        assert set(servers) == {"attention-0", "attention-1", "ffn-0"}, launch.text
        plain = plain.result(timeout=300)
        for name in ("attention-0", "attention-1"):
            check_tokens(servers[name]["url"], plain, model)
        # The FFN listened on the node's address: it demanded the secret, which
        # reached it and both attention servers only through Ray. A peer that
        # dials it with attention-0's configuration but no secret is refused.
        ffn_log = Path(servers["ffn-0"]["log"]).read_text()
        assert "AFD FFN engine started" in ffn_log
        assert_secret_demanded(servers["attention-0"]["pid"])
        assert secret not in launch.text
        for s in servers.values():
            assert secret not in Path(s["log"]).read_text()
            # Nor in any server's environment: a 0600 file names it (token_file).
            assert secret.encode() not in Path(f"/proc/{s['pid']}/environ").read_bytes()
            argv = Path(f"/proc/{s['pid']}/cmdline").read_bytes().split(b"\0")
            afd = json.loads(argv[argv.index(b"--afd-config") + 1])
            assert oct(os.stat(afd["token_file"]).st_mode & 0o777) == "0o600"

        killed_at = time.monotonic()
        os.kill(servers["attention-1"]["pid"], signal.SIGKILL)
        reported_at = launch.wait_for("server attention-1 died", timeout=REPORT_BOUND_S + 30)
        assert launch.proc.wait(TEARDOWN_BOUND_S) == 1, launch.text
    finally:
        launch.stop(signal.SIGKILL)
    assert reported_at - killed_at < REPORT_BOUND_S, reported_at - killed_at
    assert (f"server attention-1 died: killed by SIGKILL (pid "
            f"{servers['attention-1']['pid']} on") in launch.text
    # With the last lines of its log (a server that cannot start is reported the
    # same way: its log then says why).
    assert f"last lines of {servers['attention-1']['log']}:" in launch.text
    assert "Application startup complete" in launch.text
    assert "stopped 3 server(s)" in launch.text
    check_nothing_left(ray_head, spec, servers, started)
