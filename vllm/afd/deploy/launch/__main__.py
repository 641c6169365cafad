# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""python -m vllm.afd.deploy.launch SPEC: the same as `vllm-afd launch SPEC`."""

import sys

from vllm.afd.deploy.commands import main

if __name__ == "__main__":
    sys.exit(main(["launch", *sys.argv[1:]]))
