# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""What several test modules share: connector pairs and what drives them, the
oracle's runs and checks, the family matrices, reference computations, fakes
for devices that are not here. Test modules import from here, never from each
other (tests/test_hygiene.py checks it)."""
