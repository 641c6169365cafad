# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The engine adapter: everything of AFD that imports vLLM. The patch series calls
it through vllm.afd.seams only; the data plane (transport/, attention/, ffn/,
kernels/, observability/, topology.py) never imports it (tests/afd/test_import_graph.py)."""
