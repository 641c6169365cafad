# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Run a plan on a Ray cluster: one placement group per server (one bundle,
pinned to the node the plan chose), one actor per server running `vllm serve`
there, readiness with a progress bar, then watch until Ctrl-C, SIGTERM or a
server's death, and tear everything down (servers, actors, placement groups).

Only Ray's own APIs place and supervise: placement groups, actors, ray.wait.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, TextIO

from vllm.afd.deploy.launch.actor import ServerProcess, how_it_ended
from vllm.afd.deploy.launch.plan import Node, ServerPlan, describe, make_plan
from vllm.afd.deploy.launch.spec import DeploymentSpec

logger = logging.getLogger(__name__)
NAMESPACE = "vllm-afd"
POLL_S = 0.5
STOP_TIMEOUT_S = 20.0


class LaunchError(RuntimeError):
    """The deployment could not start or stopped with a failure; the message says
    which server and why."""


@dataclass
class Running:
    plan: ServerPlan
    group: Any  # PlacementGroup
    actor: Any = None
    exit_ref: Any = None
    info: dict | None = None  # pid, node, log


def _ray():
    try:
        import ray
    except ImportError as e:
        raise LaunchError("vllm-afd launch needs Ray: pip install 'vllm-afd[ray]'") from e
    return ray


def connect(address: str) -> None:
    ray = _ray()
    # Ray warns on every init that it will stop hiding accelerators from
    # zero-GPU actors; the actor handles both behaviours (actor.py).
    warnings.filterwarnings("ignore", message=".*RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO.*")
    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING,
                 log_to_driver=False, configure_logging=True)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise LaunchError(f"--address: cannot reach a Ray cluster at {address!r}: {e}") from e


def cluster_nodes() -> list[Node]:
    """Alive nodes, the launcher's own first, then by address (a stable order:
    the same spec plans the same way on the same cluster)."""
    ray = _ray()
    me = ray.get_runtime_context().get_node_id()
    nodes = [Node(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"]))
             for n in ray.nodes() if n["Alive"]]
    return sorted(nodes, key=lambda n: (n.node_id != me, n.ip, n.node_id))


class Launcher:
    def __init__(self, spec: DeploymentSpec, *, ready_timeout: float = 900.0,
                 log_dir: str | None = None, out: TextIO = sys.stdout) -> None:
        self.spec = spec
        self.ready_timeout = ready_timeout
        self.log_dir = log_dir
        self.out = out
        self.servers: list[Running] = []
        self._stop = threading.Event()
        self._stop_reason = ""

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def request_stop(self, reason: str) -> None:
        self._stop_reason = self._stop_reason or reason
        self._stop.set()

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        """Launch, wait for readiness, watch; 0 after a requested stop."""
        plans = make_plan(self.spec, cluster_nodes())
        self.say(describe(self.spec, plans))
        self._check_not_running(plans)
        t0 = time.monotonic()
        try:
            self._place(plans)
            self._start()
            self._wait_ready(t0)
            if not self._stop.is_set():
                self._print_endpoints(time.monotonic() - t0)
                self._watch()
            self.say(f"stopping: {self._stop_reason}")
            return 0
        except LaunchError as e:
            # Said before the teardown, so the reason is the first thing seen.
            print(f"vllm-afd launch: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            self.teardown()

    def _check_not_running(self, plans: list[ServerPlan]) -> None:
        ray = _ray()
        for p in plans:
            try:
                ray.get_actor(self._actor_name(p), namespace=NAMESPACE)
            except ValueError:
                continue
            raise LaunchError(f"name: deployment {self.spec.name!r} already runs on this "
                              f"cluster ({self._actor_name(p)}); stop it or pick another name")

    def _actor_name(self, p: ServerPlan) -> str:
        return f"{self.spec.name}/{p.name}"

    def _place(self, plans: list[ServerPlan]) -> None:
        from ray.util.placement_group import placement_group

        ray = _ray()
        for p in plans:
            pg = placement_group([p.bundle], strategy="STRICT_PACK",
                                 name=f"{NAMESPACE}/{self._actor_name(p)}")
            self.servers.append(Running(p, pg))
        pending = {s.group.ready(): s for s in self.servers}
        ready, not_ready = ray.wait(list(pending), num_returns=len(pending), timeout=60)
        if not_ready:
            names = ", ".join(f"{pending[r].plan.name} ({pending[r].plan.bundle})"
                              for r in not_ready)
            raise LaunchError(f"placement groups not placed within 60 s: {names}; the "
                              f"cluster lacks those resources now (ray status)")

    def _start(self) -> None:
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        secret = [ray.put(self.spec.secret.read())] if self.spec.secret else None
        # The actor's class travels by value: its worker then never imports the
        # vllm package (and torch with it), a few seconds of CPU per server.
        from ray import cloudpickle

        from vllm.afd.deploy.launch import actor as actor_module

        cloudpickle.register_pickle_by_value(actor_module)
        actor_class = ray.remote(ServerProcess)
        for s in self.servers:
            need = {k: v for k, v in s.plan.bundle.items() if not k.startswith("node:")}
            s.actor = actor_class.options(
                name=self._actor_name(s.plan), namespace=NAMESPACE, max_concurrency=4,
                num_cpus=need.pop("CPU", 0), num_gpus=need.pop("GPU", 0), resources=need,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    s.group, placement_group_bundle_index=0),
            ).remote(s.plan.name, s.plan.argv, s.plan.env, secret, self.log_dir,
                      s.plan.shm_globs, self.spec.name)
        for s, ref in [(s, s.actor.start.remote()) for s in self.servers]:
            try:
                s.info = ray.get(ref, timeout=120)
            except Exception as e:  # the actor could not be created or start its server
                raise LaunchError(f"server {s.plan.name} did not start on "
                                  f"{s.plan.node.ip}: {_first_line(e)}") from e
            s.exit_ref = s.actor.wait_exit.remote()

    def _wait_ready(self, t0: float) -> None:
        from tqdm import tqdm

        ray = _ray()
        waiting = {s.plan.name: s for s in self.servers}
        with tqdm(total=len(self.servers), desc="servers ready", unit="server",
                  file=sys.stderr, leave=False) as bar:
            while waiting and not self._stop.is_set():
                self._raise_if_one_died()
                if time.monotonic() - t0 > self.ready_timeout:
                    raise LaunchError(f"not ready after {self.ready_timeout:.0f} s: "
                                      f"{', '.join(sorted(waiting))}")
                names = list(waiting)
                try:
                    states = ray.get([waiting[n].actor.health.remote() for n in names],
                                     timeout=30)
                except Exception as e:  # an actor died: say which, from its exit
                    self._raise_if_one_died(timeout=5)
                    raise LaunchError(f"health checks failed: {_first_line(e)}") from e
                for name, (status, _) in zip(names, states):
                    if status == 200:
                        del waiting[name]
                        bar.update(1)
                        bar.set_postfix_str(f"{name} ready")
                if waiting:
                    self._stop.wait(POLL_S)

    def _raise_if_one_died(self, timeout: float = 0.0) -> None:
        ray = _ray()
        refs = {s.exit_ref: s for s in self.servers}
        done, _ = ray.wait(list(refs), num_returns=1, timeout=timeout)
        if not done:
            return
        s = refs[done[0]]
        try:
            result = ray.get(done[0])
            reason = f"{result['how']} (pid {result['pid']} on {s.info['node']})"
            tail = result["log_tail"]
        except Exception as e:  # the actor itself died: its node or process is gone
            reason = f"its Ray actor died ({type(e).__name__}: {_first_line(e)})"
            tail = ""
        message = f"server {s.plan.name} died: {reason}"
        if tail:
            message += f"\n  last lines of {s.info['log']}:\n    " + tail.replace("\n", "\n    ")
        raise LaunchError(message)

    def _print_endpoints(self, seconds: float) -> None:
        self.say(f"ready in {seconds:.1f} s")
        for s in self.servers:
            path = "/v1" if s.plan.role == "attention" else "/afd/status"
            self.say(f"  {s.plan.name:<12} {s.plan.endpoint}{path}  pid {s.info['pid']} on "
                     f"{s.info['node']}, log {s.info['log']}")
        self.say("Ctrl-C (or SIGTERM) stops the deployment")

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._raise_if_one_died(timeout=POLL_S)

    # ------------------------------------------------------------- teardown
    def teardown(self) -> None:
        """Stop every server (SIGTERM, SIGKILL after STOP_TIMEOUT_S), kill the
        actors, remove the placement groups. Safe to call twice."""
        if not self.servers:
            return
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        started = [s for s in self.servers if s.actor is not None]
        stops = [s.actor.stop.remote(STOP_TIMEOUT_S) for s in started]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=STOP_TIMEOUT_S + 10)
        for s, ref in zip(started, stops):
            try:
                code = ray.get(ref, timeout=0)
            except Exception as e:  # its actor is gone, or it did not stop in time
                self.say(f"  {s.plan.name}: no exit status ({type(e).__name__})")
                continue
            if code is not None:
                self.say(f"  {s.plan.name} {how_it_ended(code)}")
        for s in self.servers:
            if s.actor is not None:
                ray.kill(s.actor, no_restart=True)
            remove_placement_group(s.group)
        self.say(f"stopped {len(self.servers)} server(s); their actors and placement "
                 f"groups are removed")
        self.servers = []


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def launch(spec: DeploymentSpec, *, address: str = "auto", dry_run: bool = False,
           ready_timeout: float = 900.0, log_dir: str | None = None,
           out: TextIO = sys.stdout) -> int:
    """The `vllm-afd launch` command: 0 after a requested stop (or a dry run),
    1 when a server died or the deployment could not start. A SpecError (the
    plan does not fit the cluster) is raised before anything starts."""
    connect(address)
    ray = _ray()
    try:
        if dry_run:
            print(describe(spec, make_plan(spec, cluster_nodes())), file=out)
            print("dry run: nothing started", file=out)
            return 0
        launcher = Launcher(spec, ready_timeout=ready_timeout, log_dir=log_dir, out=out)
        previous = {sig: signal.signal(sig, lambda n, _f: launcher.request_stop(
            signal.Signals(n).name)) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return launcher.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        ray.shutdown()
