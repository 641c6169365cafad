# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Fixes to upstream vLLM that are not AFD (their patches say Forwarded:): the logic
of a fix patch lives here, called through vllm.afd.seams like any other."""
