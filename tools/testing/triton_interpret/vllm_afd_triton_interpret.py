# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Model Runner V2 on a CPU without a Triton CPU backend: tests only.

vLLM 0.32.0's V2 runner refuses to start on the CPU flavor unless Triton has a
`cpu` backend ("Model Runner V2 requires Triton."), and no package index these
machines reach carries one (PyPI's triton ships the nvidia and amd backends
only; there is no triton-cpu). Triton's own interpreter (TRITON_INTERPRET=1)
runs every `@triton.jit` kernel on CPU tensors through numpy, which is what the
V2 runner's input preparation, sampling and block-table kernels need.

With VLLM_AFD_TRITON_INTERPRET=1, every Python process of the environment this
module is installed in (`make test` puts it there, with a .pth line that
imports it at start-up) sets TRITON_INTERPRET=1 and adds a `cpu` entry to
`triton.backends.backends` whose driver reports itself active, which is all
vLLM's check asks (vllm/triton_utils/importing.py). Nothing is compiled: the
interpreter runs the kernels, slowly, and no serving path should run this way.
Without the variable this module does nothing (not even import triton).
"""

import os

ENV = "VLLM_AFD_TRITON_INTERPRET"


class _InterpreterDriver:
    """The `cpu` backend's driver as vLLM's Triton check sees it."""

    @staticmethod
    def is_active() -> bool:
        return True


def _install() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    # torch.compile asks the same `cpu` entry whether Triton can generate CPU
    # code, and would then ask the driver for its target: keep Inductor to its
    # C++ CPU code generation, as without Triton.
    os.environ["TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION"] = "1"
    try:
        from triton.backends import Backend, backends
    except ImportError:  # triton not installed: V2 stays refused, as upstream says
        return
    backends.setdefault("cpu", Backend(compiler=None, driver=_InterpreterDriver))


if os.environ.get(ENV) == "1":
    _install()
