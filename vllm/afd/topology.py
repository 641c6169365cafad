# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Who talks to whom: attention and FFN ranks, derived from the parallel config.

A deployment has A attention ranks and F FFN ranks (AFDConfig
num_attention_ranks / num_ffn_ranks). An attention server's ranks are its
data-parallel ranks, offset by AFDConfig.attention_rank; an FFN server's ranks
are its workers (tensor parallel, and expert parallel over the same workers),
offset by AFDConfig.ffn_rank. The workers of one FFN server form a group that
computes every token of its peers together (each holds a shard of the mlp
weights or a subset of the experts; vLLM's own collectives combine them); the
group's first rank answers. Such a group serves any number of attention ranks
too: its lead decides how their calls are batched and the other ranks follow
its orders (ffn/orders.py), so all make the same mlp calls in the same order.

    attention rank a  ->  FFN rank a % F, and every rank of that rank's group
    FFN rank f        <-  attention ranks a with a % F in f's group

So A > F (an FFN rank gathers several peers' tokens per layer), A = F, A < F
(an FFN group of several ranks), and uneven splits (3A:2F) all follow. A layout
that cannot work fails at start-up with the reason.
"""

from dataclasses import dataclass


class AFDLayoutError(ValueError):
    """The AFD rank layout cannot work with this server's parallel config."""


@dataclass(frozen=True)
class FFNPlacement:
    rank: int  # this worker's FFN rank
    group: list[int]  # the ranks of its FFN server, the lead (answering) one first

    @property
    def is_lead(self) -> bool:
        return self.rank == self.group[0]


def attention_rank(vllm_config) -> int:
    """This attention engine's rank: the server's first rank plus its DP rank."""
    afd, pc = vllm_config.afd_config, vllm_config.parallel_config
    rank = afd.attention_rank + pc.data_parallel_rank
    last = afd.attention_rank + pc.data_parallel_size - 1
    if last >= afd.num_attention_ranks:
        raise AFDLayoutError(
            f"AFD layout: this attention server's data-parallel ranks take attention ranks "
            f"{afd.attention_rank}-{last}, but num_attention_ranks is "
            f"{afd.num_attention_ranks}; raise num_attention_ranks or lower attention_rank")
    return rank


def ffn_placement(vllm_config, worker_rank: int) -> FFNPlacement:
    """FFN rank and group of the FFN server's worker `worker_rank`."""
    afd, pc = vllm_config.afd_config, vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise AFDLayoutError("AFD layout: the FFN role does not support pipeline "
                             "parallelism; use tensor parallelism (with "
                             "--enable-expert-parallel for expert parallelism)")
    if pc.data_parallel_size > 1:
        raise AFDLayoutError("AFD layout: run one FFN server per data-parallel rank "
                             "(each with its own ffn_rank) instead of --data-parallel-size")
    size = pc.world_size
    first, last = afd.ffn_rank, afd.ffn_rank + size - 1
    if last >= afd.num_ffn_ranks:
        raise AFDLayoutError(
            f"AFD layout: this FFN server's {size} worker(s) take FFN ranks {first}-{last}, "
            f"but num_ffn_ranks is {afd.num_ffn_ranks}; set num_ffn_ranks to the total "
            f"number of FFN workers in the deployment")
    group = list(range(first, last + 1))
    peers = [a for a in range(afd.num_attention_ranks) if a % afd.num_ffn_ranks in group]
    if not peers:
        raise AFDLayoutError(
            f"AFD layout: no attention rank maps to FFN ranks {first}-{last} (attention "
            f"rank a goes to FFN rank a % {afd.num_ffn_ranks}); with "
            f"{afd.num_attention_ranks} attention rank(s), this server would never be used")
    return FFNPlacement(rank=first + worker_rank, group=group)
