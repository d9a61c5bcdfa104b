"""Whole MoE layers replayed from CUDA graphs (decode steps: the host launches nothing per layer).

A layer is captured once per (layer, token bucket): the bucket is the smallest power of two
that holds the batch, at most ``max_tokens_per_rank``. A call copies its tokens into the
captured input tensors, pads the rest with rows routed nowhere (expert ids -1, weight 0: they
reach no peer and no expert, and their output is 0), replays, and returns the first T rows.

Every call is exactly one dispatch + combine round on every rank, as the eager layer is (the
ranks may use different buckets; the kernels only need the rounds to pair up): the first call
of a bucket runs the layer eagerly on the padded inputs (that compiles the kernels and fills
the allocator's pool) and returns that result, then captures the graph, which runs nothing
until the next call replays it.

Errors keep working under replay: the receive kernels flag a silent peer or an overflow on the
device, and :meth:`LayerGraphs.moe` checks the flags after each replay (one host sync), on
every transport the layer uses (a micro-batched layer has one per micro-batch).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

from .errors import EPInputError
from .transport.base import Transport


def token_bucket(num_tokens: int, max_tokens: int) -> int:
    """Smallest power of two >= num_tokens (at least 1), capped at max_tokens.
    Example: 5 -> 8, 8 -> 8, 0 -> 1; with max_tokens 24: 20 -> 24."""
    b = 1
    while b < num_tokens:
        b *= 2
    return min(b, max_tokens)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor
    out: torch.Tensor
    keep: object  # what the key names (e.g. the experts): alive as long as the graph reads it
    transports: Sequence[Transport]  # whose receives the replay flags (checked after it)


class LayerGraphs:
    """The captured layers of one rank (see the module docstring). ``layer_fn(x, ids, w)`` runs
    one whole layer on the device and returns its output; ``transport`` is the one it uses
    (its receives are deferred during capture and checked after each replay)."""

    def __init__(self, transport: Transport, max_tokens: int):
        self.transport = transport
        self.max_tokens = max_tokens
        self._graphs: dict[tuple, _Captured] = {}
        self.captures = 0
        self.replays = 0

    def moe(self, key: Hashable, layer_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
            x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
            keep: object = None, transports: Sequence[Transport] | None = None) -> torch.Tensor:
        """One layer for T tokens through the graph of (key, bucket(T)); out [T, H] (a new tensor).
        ``keep``: an object the graph reads through raw pointers (the experts), held with it.
        ``transports``: those the layer uses, if not only this one's (a micro-batched layer's)."""
        T = x_TH.shape[0]
        if T > self.max_tokens:  # checked here too: callers skip validation (validate=False) in hot loops
            raise EPInputError(f"{T} tokens exceed max_tokens_per_rank = {self.max_tokens}, the largest token "
                               f"bucket a layer is captured for; split the batch or raise max_tokens_per_rank")
        if x_TH.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the inputs are on {x_TH.device}")
        bucket = token_bucket(T, self.max_tokens)
        full = (key, bucket, x_TH.dtype)
        c = self._graphs.get(full)
        if c is None:
            x = x_TH.new_zeros(bucket, x_TH.shape[1])
            ids = topk_ids_TK.new_full((bucket, topk_ids_TK.shape[1]), -1)
            w = topk_weights_TK.new_zeros(bucket, topk_weights_TK.shape[1])
            self._fill(x, ids, w, x_TH, topk_ids_TK, topk_weights_TK)
            out = layer_fn(x, ids, w)[:T].clone()  # this call's round, eager: compiles, warms the pool
            torch.cuda.synchronize(x.device)
            graph = torch.cuda.CUDAGraph()
            used = list(transports) if transports else [self.transport]
            with contextlib.ExitStack() as deferred:  # no host sync may happen inside the capture
                for t in used:
                    deferred.enter_context(t.deferred_checks())
                with torch.cuda.graph(graph):
                    captured_out = layer_fn(x, ids, w)
            self._graphs[full] = _Captured(graph, x, ids, w, captured_out, keep, used)
            self.captures += 1
            return out
        self._fill(c.x, c.ids, c.w, x_TH, topk_ids_TK, topk_weights_TK)
        c.graph.replay()
        self.replays += 1
        for t in c.transports:
            t.check_status()  # a timeout or overflow the replay flagged on the device
        return c.out[:T].clone()

    @staticmethod
    def _fill(x, ids, w, x_TH, topk_ids_TK, topk_weights_TK) -> None:
        T = x_TH.shape[0]
        x[:T].copy_(x_TH)
        x[T:].zero_()
        ids[:T].copy_(topk_ids_TK)
        ids[T:].fill_(-1)
        w[:T].copy_(topk_weights_TK)
        w[T:].zero_()

    def stats(self) -> dict:
        return {"graphs": len(self._graphs), "captures": self.captures, "replays": self.replays}
