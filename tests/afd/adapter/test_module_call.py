# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""adapter/model/module_call.py: a module called through call_module behaves as
module(...) does: every kind of hook runs, a compiled module runs compiled.
(That it skips nn.Module.__call__ otherwise is a cost, measured by
`make bench-layer-call`'s `model` rows, not asserted here.)"""

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from vllm.afd.adapter.model.module_call import call_module


class Double(nn.Module):
    def forward(self, x):
        return x * 2


def test_without_hooks_it_is_the_forward():
    x = torch.randn(3, 4)
    assert torch.equal(call_module(Double(), x), x * 2)


def test_the_modules_own_forward_hooks_run():
    m, x = Double(), torch.randn(3, 4)
    with m.register_forward_pre_hook(lambda module, args: (args[0] + 1,)):
        assert torch.equal(call_module(m, x), (x + 1) * 2)
    with m.register_forward_hook(lambda module, args, out: out * 3):
        assert torch.equal(call_module(m, x), x * 6)
    assert torch.equal(call_module(m, x), x * 2)


def test_global_forward_hooks_run():
    m, x, seen = Double(), torch.randn(3, 4), []
    with nn_module.register_module_forward_pre_hook(lambda module, args: seen.append("pre")):
        call_module(m, x)
    with nn_module.register_module_forward_hook(lambda module, args, out: seen.append("post")):
        call_module(m, x)
    assert seen == ["pre", "post"]


def test_backward_hooks_run():
    m, seen = Double(), []
    x = torch.randn(3, 4, requires_grad=True)
    with m.register_full_backward_hook(lambda module, gin, gout: seen.append("module")):
        call_module(m, x).sum().backward()
    with nn_module.register_module_full_backward_hook(
            lambda module, gin, gout: seen.append("global")):
        call_module(m, x).sum().backward()
    assert seen == ["module", "global"]


def test_a_compiled_module_runs_compiled():
    compiled = []

    def backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    m, x = Double(), torch.randn(3, 4)
    m.compile(backend=backend)
    try:
        assert torch.equal(call_module(m, x), x * 2)
    finally:
        torch._dynamo.reset()
    assert len(compiled) == 1
