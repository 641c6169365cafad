# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""The FFN role inside vLLM: EngineCore in FFN mode and `vllm serve --afd-role ffn`."""
