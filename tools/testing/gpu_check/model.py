# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""A small reference MoE decoder in plain torch (no vLLM), split the AFD way.

Each decoder layer is vLLM-shaped: attention with its input norm and the
post-attention norm stay on the attention role; the mlp (a dense SwiGLU for
layer 0, a MoE with a router, top-k experts and a shared expert for the rest)
is what the FFN role runs:

    x = embed(tokens)
    for each layer:  h = x + attn(norm1(x));  y = norm2(h);  x = h + mlp(y)
    logits = lm_head(norm(x))

The MoE computes every expert on every token and combines them with the
routing weights (no scatter, no atomics), so a token's output depends only on
that token's row: the same micro-batch gives the same bits whether it is
computed here whole or on the other side of the link. Weights come from a
seed, so both roles (two processes) build the same model.
"""

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Causal self-attention within each sequence of x (rows back to back)."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        outs, start = [], 0
        for n in seq_lens:
            def heads(t):
                return t[start:start + n].view(n, self.heads, self.head_dim).transpose(0, 1)

            o = torch.nn.functional.scaled_dot_product_attention(
                heads(q), heads(k), heads(v), is_causal=True)
            outs.append(o.transpose(0, 1).reshape(n, -1))
            start += n
        return self.out(torch.cat(outs) if len(outs) > 1 else outs[0])


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, y: torch.Tensor, routing=None) -> torch.Tensor:
        gate, up = self.gate_up(y).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


class MoE(nn.Module):
    def __init__(self, hidden: int, inner: int, experts: int, topk: int) -> None:
        super().__init__()
        self.topk = topk
        self.gate = nn.Linear(hidden, experts, bias=False)  # the router
        self.experts = nn.ModuleList(DenseMLP(hidden, inner) for _ in range(experts))
        self.shared = DenseMLP(hidden, inner)

    def route(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights float32, top-k ids int32), renormalized softmax."""
        probs = torch.softmax(self.gate(y).float(), dim=-1)
        weights, ids = probs.topk(self.topk, dim=-1)
        return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)

    def forward(self, y: torch.Tensor, routing=None) -> torch.Tensor:
        weights, ids = routing if routing is not None else self.route(y)
        out = self.shared(y).float()
        for e, expert in enumerate(self.experts):
            w = (weights * (ids == e)).sum(-1, keepdim=True)  # 0 for unrouted tokens
            out = out + w * expert(y).float()
        return out.to(y.dtype)


class Layer(nn.Module):
    def __init__(self, index: int, hidden: int, heads: int, inner: int, experts: int,
                 topk: int) -> None:
        super().__init__()
        self.norm1 = nn.Parameter(torch.ones(hidden))
        self.norm2 = nn.Parameter(torch.ones(hidden))
        self.attn = Attention(hidden, heads)
        self.mlp = DenseMLP(hidden, inner) if index == 0 else MoE(hidden, inner, experts, topk)

    def attention_part(self, x: torch.Tensor, seq_lens: list[int]):
        """The attention role's share: (h, y) with y the mlp's input."""
        h = x + self.attn(rms_norm(x, self.norm1), seq_lens)
        return h, rms_norm(h, self.norm2)


class TinyMoEDecoder(nn.Module):
    def __init__(self, vocab: int = 96, hidden: int = 64, heads: int = 4, layers: int = 3,
                 inner: int = 96, experts: int = 4, topk: int = 2, seed: int = 0) -> None:
        super().__init__()
        self.hidden, self.topk = hidden, topk
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(i, hidden, heads, inner, experts, topk)
                                    for i in range(layers))
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
                else:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))

    def moe_layers(self) -> dict[int, int]:
        """MoE layer -> experts per token (the routing width)."""
        return {i: layer.mlp.topk for i, layer in enumerate(self.layers)
                if isinstance(layer.mlp, MoE)}

    def forward(self, tokens: torch.Tensor, seq_lens: list[int], mlp=None) -> torch.Tensor:
        """Logits of one micro-batch. mlp(layer, y, x_shape_like) -> mlp output:
        the FFN (remote or local); by default this model's own mlp."""
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            h, y = layer.attention_part(x, seq_lens)
            x = h + (layer.mlp(y) if mlp is None else mlp(i, y))
        return self.lm_head(rms_norm(x, self.norm))

    def reference(self, tokens: torch.Tensor, ubatches: list[list[int]],
                  through=None, route_before=False) -> torch.Tensor:
        """The whole model in this process, micro-batch by micro-batch
        (ubatches: the sequence lengths of each). through(x): what the link
        does to a tensor each way (None: nothing, the exact transfer).
        route_before: the MoE layers' routers see the hidden states before
        the link does anything to them (gate_on "attention": routed on the
        attention side, the routing sent exactly)."""
        mlp = None
        if through is not None:
            def mlp(i: int, y: torch.Tensor) -> torch.Tensor:
                ffn = self.layers[i].mlp
                routing = ffn.route(y) if route_before and hasattr(ffn, "route") else None
                return through(ffn(through(y), routing))
        outs, start = [], 0
        for seq_lens in ubatches:
            n = sum(seq_lens)
            outs.append(self.forward(tokens[start:start + n], seq_lens, mlp))
            start += n
        return torch.cat(outs)


def fp8_round_trip(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x through the link's fp8 transfer, in plain torch: per token and group
    of `group` elements, scale = amax / 448 (1 for an all-zero group), x / scale
    to float8 e4m3fn and back, times scale, in x's dtype (csrc/pack.h)."""
    tokens, hidden = x.shape
    groups = -(-hidden // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - hidden)).view(
        tokens, groups, group)
    amax = xf.abs().amax(-1, keepdim=True)
    # A tensor divisor (kernels/composite.py says why): IEEE division on CUDA too.
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = torch.where(amax > 0, amax / torch.full_like(amax, fp8_max), torch.ones_like(amax))
    q = (xf / scale).to(torch.float8_e4m3fn).float() * scale
    return q.view(tokens, groups * group)[:, :hidden].to(x.dtype)
