"""Router: softmax top-k over router logits.

Legend: T tokens, E experts, K top-k.
"""

from __future__ import annotations

import torch


def route(router_logits_TE: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing in fp32.

    Returns ``topk_ids_TK`` (int32, distinct per token) and ``topk_weights_TK`` (fp32); with
    ``renormalize`` the K weights of a token sum to 1.

    >>> ids, w = route(torch.tensor([[0.0, 2.0, 1.0]]), top_k=2)
    >>> ids.tolist(), [round(v, 3) for v in w[0].tolist()]
    ([[1, 2]], [0.731, 0.269])
    """
    probs = torch.softmax(router_logits_TE.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights.float()
