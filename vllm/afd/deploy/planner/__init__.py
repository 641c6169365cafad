# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""`vllm-afd plan`: how many attention and FFN devices, how many micro-batches and
what batch give the most tokens/s per device under a TPOT SLO.

One concept per module: model.py (a model's shapes), hardware.py (device profiles,
profiles/*.toml), cost.py (per-layer roofline times), pipeline.py (the overlap of m
micro-batches), search.py (the A, F, m, batch search), calibrate.py (the `cpu`
profile, measured), report.py (table, JSON), plot.py (PNG), cli.py (the command).
Nothing here imports vLLM: the planner runs anywhere with Python (torch only for
--calibrate, matplotlib only for --plot).
"""
