"""A small MoE transformer whose MLPs are expert-parallel MoE layers run by the EP workers.

Legend: V vocab size, H hidden size, NH attention heads, D = H / NH head size, P positions
of a sequence (its length), B sequences, T tokens on a rank (the sum of its sequences'
lengths), E routed experts, S shared experts, K top-k, F expert intermediate size, R ranks,
L = E / R.

Architecture (pre-norm decoder, no biases, weights stored [in, out] so ``y = x @ W``)::

    x = embed[tokens]                                          # [T, H] fp32
    for each layer i:
        x = x + attention_i(rms_norm(x) * attn_norm_i)         # causal, RoPE, per sequence
        h = rms_norm(x) * mlp_norm_i
        topk_ids, topk_weights = route(h @ router_i, K)        # softmax top-k, renormalised
        x = x + moe_i(bf16(h), topk_ids, topk_weights)         # the EP layer (shared experts inside)
    logits = (rms_norm(x) * norm) @ head                       # [T, V] fp32

Dense math runs in fp32; experts run in bf16 with fp32 accumulation exactly as the EP layer
does. Attention uses rotate-half RoPE (base ``rope_theta``) over positions 0..P-1 of each
sequence and needs no KV cache: a generation step recomputes the whole sequence (fine for a
small model).

How the model is split over R workers (data-parallel attention, expert-parallel MoE)
    Every worker holds the dense weights (embedding, attention, norms, routers, head),
    installed once into ``worker.state`` through :meth:`EPCluster.run`, and its slice of each
    layer's experts (:meth:`EPCluster.load_experts`, layer i = MoE layer i). A batch of
    sequences is split across the ranks (whole sequences, longest first onto the least
    loaded rank, at most ``max_tokens_per_rank`` tokens each; what does not fit runs in a
    further round). Each rank embeds and attends over its own sequences and calls
    ``worker.moe`` for every layer - collectively, with 0 tokens when it holds none - so the
    tokens of all ranks meet their experts wherever they live. The head runs only on the
    last position of each sequence; ranks return its top logits.

Checkpoint layout (safetensors; any float dtype, converted on load: dense to fp32, experts
to bf16, except fp8 experts, which stay fp8 with their block scales). ``i`` runs over
0..n_layers-1; the ``shared_experts`` keys exist iff n_shared_experts > 0; the
``_scale_inv`` keys of routed (or shared) experts exist iff that layer's routed (shared)
experts are float8_e4m3fn (both weights), one fp32 scale per 128 x 128 block, ``weight = q *
scale`` (DeepSeek-V3's ``weight_scale_inv``, in this layout's [in, out] blocks; H and F
multiples of 128). The
optional metadata entry ``ray_ep.model_config`` holds the :class:`MoEModelConfig` as JSON
(written by :func:`save_checkpoint`).

=================================  ===============  ============================================
key                                shape            meaning
=================================  ===============  ============================================
embed                              [V, H]           token embedding
layers.{i}.attn_norm               [H]              RMSNorm scale before attention
layers.{i}.wqkv                    [H, 3H]          columns q | k | v; head j at j*D:(j+1)*D
layers.{i}.wo                      [H, H]           attention output projection
layers.{i}.mlp_norm                [H]              RMSNorm scale before the MoE
layers.{i}.router                  [H, E]           router logits = h @ router
layers.{i}.experts.w_gate_up       [E, H, 2F]       routed experts, columns gate | up
layers.{i}.experts.w_down          [E, F, H]        routed experts, down projection
layers.{i}.experts.w_gate_up_scale_inv [E, H/128, 2F/128]  fp8 routed experts only: block scales
layers.{i}.experts.w_down_scale_inv  [E, F/128, H/128]  fp8 routed experts only: block scales
layers.{i}.shared_experts.w_gate_up  [S_sh, H, 2F]  shared experts (every token), gate | up
layers.{i}.shared_experts.w_down   [S_sh, F, H]     shared experts, down projection
layers.{i}.shared_experts.w_gate_up_scale_inv [S_sh, H/128, 2F/128]  fp8 shared experts only
layers.{i}.shared_experts.w_down_scale_inv  [S_sh, F/128, H/128]  fp8 shared experts only
norm                               [H]              final RMSNorm scale
head                               [H, V]           output head (logits = h @ head)
=================================  ===============  ============================================

An expert computes ``(silu(x @ Wg) * (x @ Wu)) @ Wd`` with ``[Wg | Wu] = w_gate_up[e]``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .. import reference
from ..config import FP8_GROUP, EPConfig
from ..errors import EPInputError
from ..routing import route
from ..weights import ExpertWeights, check_expert_weights, init_expert_weights

log = logging.getLogger(__name__)

STATE_KEY = "ray_ep.serving.model"  # the entry of worker.state that holds the dense weights
METADATA_KEY = "ray_ep.model_config"  # safetensors metadata entry with the config as JSON

# |logits - reference| / max|reference| that the EP forward may show against
# forward_reference, by the workers' device (measured on CPU, 2 workers: 1.3e-3 at worst).
# cpu: the same torch ops as the reference (the kernels' torch twins), yet the last bit of an
# fp32 GEMM depends on the thread count (workers use one thread) and the rows per call (a rank
# packs fewer rows than the one-process reference). The MoE input is rounded to bf16 and the
# experts round to bf16 between stages, so a 1e-7 difference can move one element across a
# bf16 rounding step (2^-8 relative), which the residual stream carries to the logits.
# cuda: the Triton grouped GEMMs (either backend) and cuBLAS accumulate in other orders than
# the CPU reference, so expert outputs differ by about one bf16 rounding everywhere. Greedy
# choices can only differ where the best two logits are within this tolerance (a near tie).
LOGIT_TOLERANCE = {"cpu": 1e-2, "cuda": 5e-2}


class MoEModelConfig(BaseModel):
    """Sizes of the MoE transformer. The EP topology (ranks, wire dtypes, backend) is not part
    of the model: :meth:`ep_config` builds the :class:`EPConfig` of a deployment.

    >>> cfg = MoEModelConfig(vocab_size=64, hidden_size=128, n_layers=2, n_heads=4,
    ...                      max_seq_len=64, n_experts=16, top_k=4, intermediate_size=64)
    >>> cfg.head_dim, cfg.ep_config(world_size=2, max_tokens_per_rank=256).experts_per_rank
    (32, 8)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(default=64, gt=0)
    """V: token ids are 0..V-1."""
    hidden_size: int = Field(default=128, gt=0)
    """H: width of the residual stream (a multiple of 8: EP rows are 16-byte multiples)."""
    n_layers: int = Field(default=2, gt=0)
    """Decoder layers; layer i's MoE is EP layer i."""
    n_heads: int = Field(default=4, gt=0)
    """NH: attention heads; D = H / NH must be even (RoPE rotates pairs)."""
    max_seq_len: int = Field(default=64, gt=0)
    """Longest sequence (prompt plus generated tokens fed back)."""
    n_experts: int = Field(default=16, gt=0)
    """E: routed experts per MoE layer."""
    top_k: int = Field(default=4, gt=0)
    """K: experts per token."""
    intermediate_size: int = Field(default=64, gt=0)
    """F: inner width of each SwiGLU expert."""
    n_shared_experts: int = Field(default=0, ge=0)
    """Shared experts applied to every token."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base."""
    norm_eps: float = Field(default=1e-5, gt=0)
    """RMSNorm epsilon."""

    @property
    def head_dim(self) -> int:
        """D = H / NH."""
        return self.hidden_size // self.n_heads

    @model_validator(mode="after")
    def _check(self) -> "MoEModelConfig":
        H, NH = self.hidden_size, self.n_heads
        if H % NH != 0 or (H // NH) % 2 != 0:
            raise ValueError(f"hidden_size (H) = {H} must be divisible by n_heads (NH) = {NH} into an even "
                             f"head size (RoPE rotates pairs); got H / NH = {H / NH:g}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k (K) = {self.top_k} must be <= n_experts (E) = {self.n_experts}")
        if H % 8 != 0:
            raise ValueError(f"hidden_size (H) = {H} must be a multiple of 8 (EP moves 16-byte bf16 rows)")
        return self

    def ep_config(self, *, world_size: int, max_tokens_per_rank: int, n_nodes: int = 1,
                  **ep_fields: Any) -> EPConfig:
        """The EPConfig that runs this model's MoE layers on ``world_size`` ranks (over
        ``n_nodes`` nodes); ``ep_fields`` sets the other EPConfig fields (backend,
        dispatch_dtype, combine_dtype, timeouts...)."""
        if world_size % n_nodes != 0:
            raise ValueError(f"workers = {world_size} must be divisible by nodes = {n_nodes}")
        for k in ("hidden_size", "n_experts", "top_k", "intermediate_size", "n_shared_experts"):
            if k in ep_fields and ep_fields[k] != getattr(self, k):
                raise ValueError(f"EP field {k} = {ep_fields[k]} contradicts the model's {k} = {getattr(self, k)}")
        return EPConfig(**{**ep_fields, "hidden_size": self.hidden_size, "n_experts": self.n_experts,
                           "top_k": self.top_k, "intermediate_size": self.intermediate_size,
                           "n_shared_experts": self.n_shared_experts, "max_tokens_per_rank": max_tokens_per_rank,
                           "n_nodes": n_nodes, "gpus_per_node": world_size // n_nodes})

    def expert_config(self) -> EPConfig:
        """A one-rank EPConfig with this model's expert sizes (weight init, the reference)."""
        return self.ep_config(world_size=1, max_tokens_per_rank=1)


# ---- weights -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelWeights:
    """All weights of the model on the CPU: ``dense`` (checkpoint keys without the expert
    entries, fp32) and ``experts[i]`` (layer i's routed and shared experts, bf16 or fp8)."""

    config: MoEModelConfig
    dense: dict[str, torch.Tensor]
    experts: list[ExpertWeights]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor under its checkpoint key (see the module docstring)."""
        out = dict(self.dense)
        for i, w in enumerate(self.experts):
            out[f"layers.{i}.experts.w_gate_up"] = w.w_gate_up
            out[f"layers.{i}.experts.w_down"] = w.w_down
            if w.fp8:
                out[f"layers.{i}.experts.w_gate_up_scale_inv"] = w.w_gate_up_scales
                out[f"layers.{i}.experts.w_down_scale_inv"] = w.w_down_scales
            if self.config.n_shared_experts:
                out[f"layers.{i}.shared_experts.w_gate_up"] = w.shared_gate_up
                out[f"layers.{i}.shared_experts.w_down"] = w.shared_down
                if w.shared_fp8:
                    out[f"layers.{i}.shared_experts.w_gate_up_scale_inv"] = w.shared_gate_up_scales
                    out[f"layers.{i}.shared_experts.w_down_scale_inv"] = w.shared_down_scales
        return out

    @classmethod
    def from_state_dict(cls, config: MoEModelConfig, tensors: dict[str, torch.Tensor],
                        source: str = "state dict") -> "ModelWeights":
        """Check every key and shape against ``config`` (errors name the key, both shapes)."""
        want = checkpoint_shapes(config)
        missing = sorted(set(want) - set(tensors))
        extra = sorted(set(tensors) - set(want) - set(scale_shapes(config)))
        if missing or extra:
            raise EPInputError(f"{source} does not match the model config: missing keys {missing[:8]}"
                               f"{'...' if len(missing) > 8 else ''}, unexpected keys {extra[:8]}"
                               f"{'...' if len(extra) > 8 else ''} (layout: see ray_ep.serving.model)")
        for k, shape in want.items():
            t = tensors[k]
            if tuple(t.shape) != shape:
                raise EPInputError(f"{source}: {k} has shape {list(t.shape)}, the config needs {list(shape)}")
            if not t.is_floating_point():
                raise EPInputError(f"{source}: {k} has dtype {t.dtype}; weights must be floating point")
        dense = {k: tensors[k].float().contiguous() for k in want if ".experts." not in k and
                 ".shared_experts." not in k}
        H, Fi = config.hidden_size, config.intermediate_size

        def bf16(key: str, empty_shape: tuple[int, ...]) -> torch.Tensor:
            if key in tensors:
                t = tensors[key]  # fp8 experts stay fp8 (with their scales, below)
                return (t if t.dtype == torch.float8_e4m3fn else t.to(torch.bfloat16)).contiguous()
            return torch.empty(empty_shape, dtype=torch.bfloat16)  # no shared experts

        experts = []
        for i in range(config.n_layers):
            p, sp = f"layers.{i}.experts.", f"layers.{i}.shared_experts."
            w = ExpertWeights(bf16(p + "w_gate_up", ()), bf16(p + "w_down", ()),
                              bf16(sp + "w_gate_up", (0, H, 2 * Fi)), bf16(sp + "w_down", (0, Fi, H)),
                              *(tensors.get(k + "_scale_inv") for k in (p + "w_gate_up", p + "w_down",
                                                                        sp + "w_gate_up", sp + "w_down")))
            check_expert_weights(config.expert_config(), w, where=f"{source} layer {i}")
            experts.append(w)
        return cls(config, dense, experts)


def checkpoint_shapes(config: MoEModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint key of ``config`` and its shape, in a fixed order."""
    V, H, E, Fi, S = (config.vocab_size, config.hidden_size, config.n_experts, config.intermediate_size,
                      config.n_shared_experts)
    out: dict[str, tuple[int, ...]] = {"embed": (V, H)}
    for i in range(config.n_layers):
        p = f"layers.{i}."
        out.update({p + "attn_norm": (H,), p + "wqkv": (H, 3 * H), p + "wo": (H, H), p + "mlp_norm": (H,),
                    p + "router": (H, E), p + "experts.w_gate_up": (E, H, 2 * Fi), p + "experts.w_down": (E, Fi, H)})
        if S:
            out.update({p + "shared_experts.w_gate_up": (S, H, 2 * Fi), p + "shared_experts.w_down": (S, Fi, H)})
    out.update({"norm": (H,), "head": (H, V)})
    return out


def scale_shapes(config: MoEModelConfig) -> dict[str, tuple[int, ...]]:
    """The optional block-scale keys of fp8 routed and shared experts and their shapes."""
    H, Fi, G = config.hidden_size, config.intermediate_size, FP8_GROUP
    parts = [("experts", config.n_experts)] + ([("shared_experts", config.n_shared_experts)]
                                               if config.n_shared_experts else [])
    out = {}
    for i in range(config.n_layers):
        for part, n in parts:
            out[f"layers.{i}.{part}.w_gate_up_scale_inv"] = (n, H // G, 2 * Fi // G)
            out[f"layers.{i}.{part}.w_down_scale_inv"] = (n, Fi // G, H // G)
    return out


def init_model_weights(config: MoEModelConfig, seed: int = 0) -> ModelWeights:
    """Seeded random weights, scaled so activations stay O(1); the same on every machine.

    Dense tensors draw from one generator (seed) in checkpoint-key order; layer i's experts
    come from :func:`ray_ep.weights.init_expert_weights` with seed ``seed * 1000 + 1 + i``.
    """
    g = torch.Generator().manual_seed(seed)
    H, L = config.hidden_size, config.n_layers
    dense: dict[str, torch.Tensor] = {}
    for k, shape in checkpoint_shapes(config).items():
        if "experts." in k:
            continue
        if k.endswith("norm"):
            dense[k] = torch.ones(shape)
        elif k == "embed":
            dense[k] = torch.randn(shape, generator=g)
        elif k.endswith(".wo"):  # residual branches shrink with depth
            dense[k] = torch.randn(shape, generator=g) / math.sqrt(H * 2 * L)
        else:  # wqkv, router, head: fan-in scaling
            dense[k] = torch.randn(shape, generator=g) / math.sqrt(H)
    ecfg = config.expert_config()
    experts = [init_expert_weights(ecfg, seed=seed * 1000 + 1 + i) for i in range(L)]
    return ModelWeights(config, dense, experts)


def save_checkpoint(weights: ModelWeights, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write a safetensors checkpoint (the layout above) with the config in its metadata;
    ``dtype`` casts every tensor (e.g. bf16 to halve the file) but fp8 experts and their scales."""
    from safetensors.torch import save_file

    def cast(k: str, v: torch.Tensor) -> torch.Tensor:
        keep = dtype is None or v.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv")
        return (v if keep else v.to(dtype)).contiguous()

    tensors = {k: cast(k, v) for k, v in weights.state_dict().items()}
    save_file(tensors, str(path), metadata={METADATA_KEY: weights.config.model_dump_json()})


def read_checkpoint_config(path: str | Path) -> MoEModelConfig | None:
    """The config stored in a checkpoint's metadata, or None if it has none."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    text = meta.get(METADATA_KEY)
    return MoEModelConfig(**json.loads(text)) if text else None


def check_checkpoint(path: str | Path, config: MoEModelConfig) -> None:
    """Raise EPInputError unless the checkpoint's keys and shapes fit ``config``; reads only
    the file's header (cheap: the server checks before starting anything)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    want = checkpoint_shapes(config)
    optional = scale_shapes(config)
    missing, extra = sorted(set(want) - set(shapes)), sorted(set(shapes) - set(want) - set(optional))
    if missing or extra:
        raise EPInputError(f"checkpoint {path} does not match the model config: missing keys {missing[:8]}, "
                           f"unexpected keys {extra[:8]} (layout: see ray_ep.serving.model)")
    for k, shape in [*want.items(), *((k, v) for k, v in optional.items() if k in shapes)]:
        if shapes[k] != shape:
            raise EPInputError(f"checkpoint {path}: {k} has shape {list(shapes[k])}, the config needs {list(shape)}")


def load_checkpoint(path: str | Path, config: MoEModelConfig | None = None) -> ModelWeights:
    """Weights from a safetensors checkpoint. ``config`` None takes the config stored in the
    checkpoint's metadata; a given config must match every shape."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if config is None:
        config = read_checkpoint_config(path)
        if config is None:
            raise EPInputError(f"checkpoint {path} has no '{METADATA_KEY}' metadata: give the model config "
                               f"(flags or YAML) that matches its shapes")
    return ModelWeights.from_state_dict(config, load_file(str(path)), source=f"checkpoint {path}")


# ---- the forward (shared by the workers and the reference) ---------------------------------
MoEFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""moe(layer, x_TH bf16, topk_ids_TK int32, topk_weights_TK fp32) -> [T, H] (fp32)."""


def _rms_norm(x_TH: torch.Tensor, w_H: torch.Tensor, eps: float) -> torch.Tensor:
    return x_TH * torch.rsqrt(x_TH.pow(2).mean(dim=-1, keepdim=True) + eps) * w_H


def _rope_tables(config: MoEModelConfig, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq_len, D / 2] fp32."""
    D = config.head_dim
    inv = 1.0 / config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(config.max_seq_len, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def _rope(x: torch.Tensor, cos_PD2: torch.Tensor, sin_PD2: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [..., P, NH, D] with tables [P, D / 2]."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos_PD2[:, None, :], sin_PD2[:, None, :]
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)


@dataclass(frozen=True)
class _Padding:
    """Where the packed rows of B sequences sit in a batch padded to the longest, P: ``rows``
    [T] int64 on the device, packed row -> its (sequence, position) row b * P + p."""

    B: int
    P: int
    rows: torch.Tensor

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device | str) -> "_Padding":
        B, P = len(lengths), max(lengths)
        rows = [b * P + p for b, n in enumerate(lengths) for p in range(n)]
        return cls(B, P, torch.tensor(rows, dtype=torch.int64, device=device))


def _attention(h_TH: torch.Tensor, wqkv: torch.Tensor, wo: torch.Tensor, pad: _Padding, n_heads: int,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of each packed sequence on its own (rows of one sequence are
    contiguous in h_TH, in the order of ``pad``), all sequences in one call: padded to the
    longest, where causality alone keeps every real row from the padding after it (a row
    at position p < n sees keys 0..p only). A loop over sequences cost ~10 launches per
    sequence and layer, most of the toy model's step on a GPU (20.9 of 35 ms, docs/serving.md)."""
    H = h_TH.shape[1]
    D = H // n_heads
    B, P = pad.B, pad.P
    qkv = h_TH.new_zeros(B * P, 3 * H).index_copy_(0, pad.rows, h_TH @ wqkv)
    q, k, v = qkv.view(B, P, 3, n_heads, D).unbind(2)  # [B, P, NH, D] each
    q, k = _rope(q, cos[:P], sin[:P]), _rope(k, cos[:P], sin[:P])
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return o.transpose(1, 2).reshape(B * P, H).index_select(0, pad.rows) @ wo


def forward_tokens(config: MoEModelConfig, dense: dict[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                   sequences: Sequence[Sequence[int]], moe: MoEFn, device: torch.device | str = "cpu",
                   timer: Callable[[str], Any] | None = None) -> torch.Tensor:
    """Last-position logits [B, V] fp32 of B sequences (any B >= 0, packed into one [T, H]).

    ``moe`` runs MoE layer i; it is called for every layer even when B == 0 (the EP layer is
    collective). ``timer(name)`` (a context manager) times the dense part, if given.
    """
    lengths = [len(s) for s in sequences]
    T, H, V = sum(lengths), config.hidden_size, config.vocab_size
    time_phase = timer or (lambda name: contextlib.nullcontext())
    with time_phase("dense"):
        flat = [t for s in sequences for t in s]
        tokens = torch.tensor(flat, dtype=torch.int64, device=device)
        x = dense["embed"][tokens] if T else torch.zeros(0, H, device=device)
        pad = _Padding.of(lengths, device) if T else None  # once for every layer's attention
    for i in range(config.n_layers):
        p = f"layers.{i}."
        with time_phase("dense"):
            if T:
                h = _rms_norm(x, dense[p + "attn_norm"], config.norm_eps)
                x = x + _attention(h, dense[p + "wqkv"], dense[p + "wo"], pad, config.n_heads, *rope)
            h = _rms_norm(x, dense[p + "mlp_norm"], config.norm_eps)
            topk_ids, topk_weights = route(h @ dense[p + "router"], config.top_k)
        x = x + moe(i, h.to(torch.bfloat16), topk_ids, topk_weights).float()
    with time_phase("dense"):
        last = torch.tensor([end - 1 for end in itertools.accumulate(lengths)], dtype=torch.int64, device=device)
        h = _rms_norm(x[last], dense["norm"], config.norm_eps)
        return (h @ dense["head"]).float() if len(lengths) else torch.zeros(0, V, device=device)


# ---- the single-process reference ----------------------------------------------------------
def moe_layer_reference(x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                        weights: ExpertWeights, *, world_size: int = 1, combine_dtype: str = "fp32",
                        dispatch_dtype: str = "bf16") -> torch.Tensor:
    """One MoE layer in one process with the roundings of the EP layer on ``world_size``
    ranks: rows go on the wire in ``dispatch_dtype``, each expert is
    :func:`ray_ep.reference.swiglu_expert`, each rank sums the weighted outputs of its own
    experts per token in fp32 and sends that partial in ``combine_dtype``; the source adds
    the partials in rank order in fp32, then the shared experts. Returns [T, H] fp32.

    With ``world_size=1, combine_dtype='fp32'`` this is the plain MoE math of
    :func:`ray_ep.reference.moe_forward`.
    """
    T, H = x_TH.shape
    E, K = weights.w_gate_up.shape[0], topk_ids_TK.shape[1]
    if E % world_size:
        raise ValueError(f"n_experts = {E} must be divisible by world_size = {world_size}")
    L = E // world_size
    x_in = x = x_TH.to(torch.bfloat16)
    if dispatch_dtype == "fp8":
        x = reference.dequantize_fp8(*reference.quantize_fp8(x)).to(torch.bfloat16)
    elif dispatch_dtype == "nvfp4":
        x = reference.dequantize_nvfp4(*reference.quantize_nvfp4(x)).to(torch.bfloat16)
    if weights.fp8:  # the GEMM's fp8 rows: fp8 dispatch's, or bf16 / nvfp4 rows quantised the same way
        xq, xs = reference.quantize_fp8(x_in if dispatch_dtype in ("bf16", "fp8") else x)
    ids = topk_ids_TK.long()
    y_TKH = torch.zeros(T, K, H, dtype=torch.bfloat16)
    for e in torch.unique(ids[ids >= 0]).tolist():
        t, k = torch.nonzero(ids == e, as_tuple=True)
        if weights.fp8:
            y_TKH[t, k] = reference.swiglu_expert_fp8(xq[t], xs[t], weights.w_gate_up[e], weights.w_gate_up_scales[e],
                                                      weights.w_down[e], weights.w_down_scales[e])
        else:
            y_TKH[t, k] = reference.swiglu_expert(x[t], weights.w_gate_up[e], weights.w_down[e])
    wire = {"bf16": torch.bfloat16, "fp32": torch.float32}[combine_dtype]
    acc = torch.zeros(T, H, dtype=torch.float32)
    for d in range(world_size):
        here = (ids >= 0) & (ids // L == d)
        partial = (y_TKH.float() * torch.where(here, topk_weights_TK.float(), 0.0)[..., None]).sum(dim=1)
        acc += partial.to(wire).float()
    if weights.shared_down.shape[0]:  # summed on their own first, then added once (as the EP combine does)
        acc += reference.shared_experts(x_TH.to(torch.bfloat16), weights)
    return acc


def forward_reference(weights: ModelWeights, sequences: Sequence[Sequence[int]], *, world_size: int = 1,
                      combine_dtype: str = "fp32", dispatch_dtype: str = "bf16",
                      expert_dtype: str | None = None) -> torch.Tensor:
    """Last-position logits [B, V] fp32 of the model in this process (no Ray): the same
    dense code as the workers, and :func:`moe_layer_reference` for each MoE layer with the
    wire dtypes of the EP deployment it is compared with (see LOGIT_TOLERANCE).
    ``expert_dtype``: the deployment's (its workers convert the checkpoint's experts to it at
    load); None uses the experts as they are."""
    cfg = weights.config
    check_sequences(cfg, sequences)
    experts = weights.experts if expert_dtype is None else [w.to_expert_dtype(expert_dtype) for w in weights.experts]

    def moe(i: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return moe_layer_reference(x, ids, w, experts[i], world_size=world_size, combine_dtype=combine_dtype,
                                   dispatch_dtype=dispatch_dtype)

    return forward_tokens(cfg, weights.dense, _rope_tables(cfg, "cpu"), sequences, moe)


def generate_reference(weights: ModelWeights, prompt: Sequence[int], max_new_tokens: int,
                       **kwargs: Any) -> list[int]:
    """Greedy generation with :func:`forward_reference` (kwargs go to it): the new ids."""
    seq, out = list(prompt), []
    for _ in range(max_new_tokens):
        nxt = int(torch.topk(forward_reference(weights, [seq], **kwargs)[0], 1).indices[0])
        out.append(nxt)
        seq.append(nxt)
    return out


def check_sequences(config: MoEModelConfig, sequences: Sequence[Sequence[int]]) -> None:
    """Raise EPInputError unless every sequence is 1..max_seq_len ids in [0, vocab_size)."""
    for j, s in enumerate(sequences):
        if not 0 < len(s) <= config.max_seq_len:
            raise EPInputError(f"sequence {j} has {len(s)} tokens; it needs 1..max_seq_len = {config.max_seq_len}")
        lo, hi = min(s), max(s)
        if lo < 0 or hi >= config.vocab_size:
            raise EPInputError(f"sequence {j} has token ids in [{lo}, {hi}]; they must lie in "
                               f"[0, vocab_size = {config.vocab_size})")


# ---- the model on an EPCluster ---------------------------------------------------------------
@dataclass(frozen=True)
class NextTokens:
    """Top logits of the next token of B sequences: ``top_ids`` [B, n] int64 and
    ``top_logits`` [B, n] fp32, best first (n = the top_n asked for, at least 1)."""

    top_ids: torch.Tensor
    top_logits: torch.Tensor

    @property
    def next_ids(self) -> list[int]:
        """The greedy choice of each sequence."""
        return self.top_ids[:, 0].tolist()


def pack_sequences(lengths: Sequence[int], world_size: int, capacity: int) -> list[list[list[int]]]:
    """Split sequences (by length) over ranks: rounds of per-rank index lists.

    Longest first onto the least loaded rank whose load stays <= ``capacity`` tokens; a
    sequence that fits no rank waits for the next round. Every length must be <= capacity.

    >>> pack_sequences([5, 3, 4, 2], world_size=2, capacity=8)
    [[[0, 3], [2, 1]]]
    """
    if any(n > capacity for n in lengths):
        raise EPInputError(f"a sequence of {max(lengths)} tokens exceeds max_tokens_per_rank = {capacity}")
    todo = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    rounds: list[list[list[int]]] = []
    while todo:
        ranks: list[list[int]] = [[] for _ in range(world_size)]
        load = [0] * world_size
        left = []
        for j in todo:
            r = min(range(world_size), key=lambda q: (load[q], q))
            if load[r] + lengths[j] > capacity:
                left.append(j)
                continue
            ranks[r].append(j)
            load[r] += lengths[j]
        rounds.append(ranks)
        todo = left
    return rounds


def _install_model(worker, config: MoEModelConfig, dense: dict[str, torch.Tensor]) -> int:
    """In a worker: keep the dense weights (on its device) and RoPE tables in worker.state."""
    dev = worker.device
    worker.state[STATE_KEY] = {"config": config, "dense": {k: v.to(dev) for k, v in dense.items()},
                               "rope": _rope_tables(config, dev)}
    return sum(v.numel() * v.element_size() for v in dense.values())


def _forward_rank(worker, sequences: list[list[int]], top_n: int, out_dtype: str,
                  cuda_graph: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """In a worker: forward of its sequences (maybe none), MoE layers collectively; the top
    ``top_n`` logits of each sequence's next token, as numpy arrays (ids int64, logits fp32):
    the driver unpickles two small numpy arrays in microseconds, two torch tensors from a Ray
    object in ~1 ms each, a step's serial cost on the driver. ``cuda_graph``: the MoE layers
    replay CUDA graphs (one per layer and token bucket, :mod:`ray_ep.graphs`); the phase timer
    wraps each whole layer (worker.moe's "layer" phase), so its syncs stay outside a capture."""
    st = worker.state.get(STATE_KEY)
    if st is None:
        raise RuntimeError(f"rank {worker.rank}: no model installed; EPModel.load() first")
    cfg: MoEModelConfig = st["config"]
    # the driver decided from the backend (nvshmem: GPUs); a CPU worker cannot capture, so it
    # runs the eager layer rather than fail a step
    graphs = cuda_graph and worker.device.type == "cuda"

    def moe(i: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return worker.moe(x, ids, w, layer=i, out_dtype=out_dtype, validate=False, cuda_graph=graphs)

    with torch.no_grad():
        logits = forward_tokens(cfg, st["dense"], st["rope"], sequences, moe, device=worker.device,
                                timer=worker.stats.phase)
        vals, ids = torch.topk(logits, min(top_n, cfg.vocab_size), dim=-1)
    return ids.cpu().numpy(), vals.cpu().numpy()


def _set_profiling(worker, enabled: bool) -> None:
    worker.set_profiling(enabled)


def _phase_stats(worker) -> dict:
    return worker.phase_stats()


class EPModel:
    """The model served by an :class:`~ray_ep.EPCluster`: dense weights in every worker,
    layer i's experts sharded as EP layer i (see the module docstring).

    ``cuda_graph``: replay each MoE layer from CUDA graphs captured per (layer, token bucket)
    (:mod:`ray_ep.graphs`; the same output, less launch overhead in decode steps). Only GPU
    workers on the nvshmem backend can (micro-batched layers too); elsewhere it stays off and
    :attr:`cuda_graph_status` says why.

    >>> weights = init_model_weights(MoEModelConfig(), seed=0)
    >>> with EPCluster(weights.config.ep_config(world_size=2, max_tokens_per_rank=256)) as ep:  # doctest: +SKIP
    ...     model = EPModel(ep, weights, cuda_graph=True).load()
    ...     model.generate([[1, 2, 3]], max_new_tokens=4), model.cuda_graph_status
    ([[43, 44, 48, 5]], 'on')
    """

    def __init__(self, cluster, weights: ModelWeights, cuda_graph: bool = False):
        cfg, ep = weights.config, cluster.config
        for k in ("hidden_size", "n_experts", "top_k", "intermediate_size", "n_shared_experts"):
            if getattr(ep, k) != getattr(cfg, k):
                raise EPInputError(f"the cluster's EPConfig.{k} = {getattr(ep, k)} differs from the model's "
                                   f"{k} = {getattr(cfg, k)}; build it with MoEModelConfig.ep_config()")
        if ep.max_tokens_per_rank < cfg.max_seq_len:
            raise EPInputError(f"EPConfig.max_tokens_per_rank = {ep.max_tokens_per_rank} must be >= max_seq_len = "
                               f"{cfg.max_seq_len}, so that any one sequence fits a rank")
        self.cluster = cluster
        self.weights = weights
        self.config = cfg
        # the MoE output joins the fp32 residual stream: ask the combine for fp32
        self._out_dtype = "fp32"
        self.cuda_graph_requested = bool(cuda_graph)

    @property
    def cuda_graph_status(self) -> str:
        """"on", or "off" with the reason: not asked for, CPU workers, the torch backend (its
        exchange sizes its messages on the host, which a capture cannot)."""
        if not self.cuda_graph_requested:
            return "off"
        if not self.cluster.use_gpu:
            return "off (CPU workers)"
        if self.cluster.backend != "nvshmem":
            return f"off (backend {self.cluster.backend}; graphs need nvshmem)"
        return "on"

    @property
    def cuda_graph(self) -> bool:
        """Whether the MoE layers replay CUDA graphs (see :attr:`cuda_graph_status`)."""
        return self.cuda_graph_status == "on"

    def load(self) -> "EPModel":
        """Install the dense weights in every worker and each layer's experts (collective)."""
        self.install_dense()
        for i, w in enumerate(self.weights.experts):
            self.cluster.load_experts(w, layer=i)
        log.info("ray_ep.serving.model: %d layers loaded on %d workers", self.config.n_layers,
                 self.cluster.world_size)
        return self

    def install_dense(self) -> "EPModel":
        """Install the dense weights in every worker (collective). After
        :meth:`EPCluster.restart`, which reloads the experts itself, this is all the new
        workers need."""
        import ray

        self.cluster.run(_install_model, self.config, ray.put(self.weights.dense))
        return self

    def next_tokens(self, sequences: Sequence[Sequence[int]], top_n: int = 1) -> NextTokens:
        """Top-``top_n`` logits of the next token of every sequence (one EP forward per round
        of :func:`pack_sequences`; usually one)."""
        check_sequences(self.config, sequences)
        n = max(1, min(top_n, self.config.vocab_size))
        B = len(sequences)
        ids = torch.zeros(B, n, dtype=torch.int64)
        vals = torch.zeros(B, n, dtype=torch.float32)
        R = self.cluster.world_size
        graphs = self.cuda_graph
        for ranks in pack_sequences([len(s) for s in sequences], R, self.cluster.config.max_tokens_per_rank):
            args = [([list(sequences[j]) for j in idx], n, self._out_dtype, graphs) for idx in ranks]
            outs = self.cluster.run(_forward_rank, args_per_rank=args)
            for idx, (i_r, v_r) in zip(ranks, outs):
                if idx:
                    ids[idx], vals[idx] = torch.tensor(i_r), torch.tensor(v_r)  # Ray's arrays are read-only
        return NextTokens(ids, vals)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generation of ``max_new_tokens`` for every prompt (batched)."""
        seqs = [list(p) for p in prompts]
        outs: list[list[int]] = [[] for _ in seqs]
        for _ in range(max_new_tokens):
            for j, t in enumerate(self.next_tokens(seqs).next_ids):
                outs[j].append(t)
                seqs[j].append(t)
        return outs

    def set_profiling(self, enabled: bool) -> None:
        """Per-phase timing in every worker (dense, dispatch, experts, combine; syncs the
        device) and tokens per expert. Under :attr:`cuda_graph` a MoE layer is one "layer"
        phase (a replay cannot be split) and its tokens per expert are not counted."""
        self.cluster.run(_set_profiling, enabled)

    def phase_stats(self) -> list[dict]:
        """Every worker's :meth:`EPWorker.phase_stats`, in rank order (with ``graphs``, the
        CUDA graphs captured and replayed, on GPU workers)."""
        return self.cluster.run(_phase_stats)
