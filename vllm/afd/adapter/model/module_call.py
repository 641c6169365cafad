# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A module's forward, without nn.Module.__call__ where that would add nothing.

Once per layer call each role calls a module: the attention role's decoder
layer its RemoteFFN, the FFN role's loop the layer's mlp. nn.Module.__call__
is two Python frames, a tracing-state call and eight hook lookups before it
reaches forward; on a CPU host, where the compute between two layer calls has
streamed its weights through the caches, each of those is a cache miss, and the
machinery costs several times the same lookups made here (warm, well under a
microsecond either way; figures: benchmarks/notes.md). So: forward directly
when __call__ would find nothing to run (no
hook of any kind, the module's or a global one, and no Module.compile()),
nn.Module.__call__ otherwise, hooks and all.
"""

from torch import nn
from torch.nn.modules import module as _module


def call_module(module: nn.Module, *args, **kwargs):
    """module(*args, **kwargs), as nn.Module.__call__ would run it."""
    if (module._forward_pre_hooks or module._forward_hooks or module._backward_hooks
            or module._backward_pre_hooks or _module._global_forward_pre_hooks
            or _module._global_forward_hooks or _module._global_backward_hooks
            or _module._global_backward_pre_hooks or module._compiled_call_impl is not None):
        return nn.Module.__call__(module, *args, **kwargs)
    return module.forward(*args, **kwargs)
