# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A device-resident layer exchange (issue 53): the attention and FFN roles
write each other's device memory and wait on flags in their own, with no host
on the per-layer path. layout.py says where the words and slots are, stream.py
what a device must do for it, calls.py the operations of a layer call."""
