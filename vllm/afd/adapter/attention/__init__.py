# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The attention role inside vLLM: the link in the model runners (V1 and V2),
its micro-batches there, a lost FFN failing requests, the HTTP surface."""
