# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""`vllm-afd launch SPEC`: an AFD deployment (attention and FFN servers, their
ports, ranks and secret) started on a Ray cluster, watched, and torn down.

spec.py (the file format and its checks), plan.py (servers onto nodes, command
lines), actor.py (the Ray actor running one `vllm serve`), launcher.py (placement
groups, actors, readiness, teardown). Imports nothing from vLLM: the servers are
`vllm serve` processes.
"""
