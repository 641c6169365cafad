# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""vllm-afd: Attention-FFN Disaggregation for MoE serving, inside vLLM."""

from vllm.afd.version import (
    FLAVOR,
    SERIES_DIGEST,
    UPSTREAM_VERSION,
    __version__,
    distribution_version,
)

__all__ = [
    "FLAVOR",
    "SERIES_DIGEST",
    "UPSTREAM_VERSION",
    "__version__",
    "distribution_version",
]
