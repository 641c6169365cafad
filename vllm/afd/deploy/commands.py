# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The `vllm-afd` command: deployment tools beside `vllm serve`.

  vllm-afd launch SPEC [--address auto] [--dry-run]   (vllm/afd/deploy/launch/)
  vllm-afd plan [--model M] [--hardware H] [--tpot-ms 50] [--context 4096]
                [--json] [--plot FILE.png] | --calibrate [--out FILE]  (vllm/afd/deploy/planner/)
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-afd", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    launch = commands.add_parser(
        "launch", help="start an AFD deployment on a Ray cluster from a spec file",
        description="Start the attention and FFN servers a YAML/JSON spec describes on an "
                    "existing Ray cluster, wait until all are ready, print their endpoints, "
                    "and stop them all on Ctrl-C, SIGTERM or the death of any.")
    launch.add_argument("spec", help="deployment spec (YAML or JSON); README 'Many machines'")
    launch.add_argument("--address", default="auto",
                        help="Ray cluster address (default: auto, the local node's cluster)")
    launch.add_argument("--dry-run", action="store_true",
                        help="print the plan (servers, nodes, bundles, ports, ranks) and exit")
    launch.add_argument("--ready-timeout", type=float, default=900.0,
                        help="seconds for every server to answer /health with 200")
    launch.add_argument("--log-dir", default=None,
                        help="where each node writes its servers' logs (default: "
                             "$TMPDIR/vllm-afd-launch)")
    plan = commands.add_parser(
        "plan", help="size an AFD deployment: A, F, micro-batches and batch under a TPOT SLO",
        description="From a model's shapes and a hardware profile: per-layer attention, FFN "
                    "and transfer times, the overlap of m micro-batches, and the attention "
                    "devices, FFN devices, m and batch with the most tokens/s per device "
                    "under the TPOT SLO, with the limiting regime.")
    from vllm.afd.deploy.planner.cli import add_arguments

    add_arguments(plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "launch":
        from vllm.afd.deploy.launch import spec as spec_file
        from vllm.afd.deploy.launch.launcher import LaunchError, launch

        try:
            spec = spec_file.load(args.spec)
            return launch(spec, address=args.address, dry_run=args.dry_run,
                          ready_timeout=args.ready_timeout, log_dir=args.log_dir)
        except spec_file.SpecError as e:
            print(f"vllm-afd launch: {e}", file=sys.stderr)
            return 2
        except LaunchError as e:
            print(f"vllm-afd launch: {e}", file=sys.stderr)
            return 1
    if args.command == "plan":
        import logging

        from vllm.afd.deploy.planner.cli import run

        logging.basicConfig(level=logging.INFO)
        try:
            return run(args)
        except ValueError as e:
            print(f"vllm-afd plan: {e}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
