"""``MoETransformer``: a small decoder language model whose MLPs are EP :class:`MoE` layers,
the model the training examples train (the serving example's architecture with learned
positions instead of RoPE, as trainable modules).

Legend: B sequences on this rank, P positions, V vocab size, H hidden size.

Every rank holds the dense weights (embeddings, attention, norms, routers, head) and its
slice of each layer's experts. Dense weights come from ``seed`` through the global RNG
under :func:`torch.random.fork_rng`, the experts from their own generators, so the model
starts from the same values whatever the world size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..communicator import EPCommunicator
from .layer import MoE


class _Block(nn.Module):
    def __init__(self, comm: EPCommunicator, n_heads: int, seed: int, dtype: torch.dtype):
        super().__init__()
        H = comm.config.hidden_size
        self.n_heads = n_heads
        self.attn_norm = nn.RMSNorm(H, dtype=dtype, device=comm.device)
        self.wqkv = nn.Linear(H, 3 * H, bias=False, dtype=dtype, device=comm.device)
        self.wo = nn.Linear(H, H, bias=False, dtype=dtype, device=comm.device)
        self.mlp_norm = nn.RMSNorm(H, dtype=dtype, device=comm.device)
        self.moe = MoE(comm, seed=seed, dtype=dtype)

    def forward(self, x_BPH: torch.Tensor) -> torch.Tensor:
        B, P, H = x_BPH.shape
        q, k, v = self.wqkv(self.attn_norm(x_BPH)).view(B, P, 3, self.n_heads, H // self.n_heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x_BPH = x_BPH + self.wo(a.transpose(1, 2).reshape(B, P, H))
        h = self.mlp_norm(x_BPH).reshape(B * P, H)
        return x_BPH + self.moe(h).view(B, P, H)


class MoETransformer(nn.Module):
    """Pre-norm decoder: embeddings, ``n_layers`` x (causal attention, EP MoE), RMSNorm, head.

    Args:
        comm: this rank's communicator (H, experts, top-k from its config); B * P tokens per
            forward must fit ``max_tokens_per_rank``.
        vocab_size, n_layers, n_heads, max_seq_len: the dense part.
        seed: initial weights (the same on every rank for the dense part).
        dtype: parameter dtype.
    """

    def __init__(self, comm: EPCommunicator, *, vocab_size: int = 64, n_layers: int = 2, n_heads: int = 4,
                 max_seq_len: int = 32, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        H, dev = comm.config.hidden_size, comm.device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab_size, H, dtype=dtype, device=dev)
            self.pos = nn.Embedding(max_seq_len, H, dtype=dtype, device=dev)
            self.blocks = nn.ModuleList(_Block(comm, n_heads, seed * 1000 + 1 + i, dtype) for i in range(n_layers))
            self.norm = nn.RMSNorm(H, dtype=dtype, device=dev)
            self.head = nn.Linear(H, vocab_size, bias=False, dtype=dtype, device=dev)

    def forward(self, tokens_BP: torch.Tensor) -> torch.Tensor:
        """Logits [B, P, V] of the next token at every position (collective)."""
        P = tokens_BP.shape[1]
        x = self.embed(tokens_BP) + self.pos(torch.arange(P, device=tokens_BP.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens_BP: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over this rank's B x (P - 1) predictions."""
        logits = self(tokens_BP[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens_BP[:, 1:].reshape(-1))
