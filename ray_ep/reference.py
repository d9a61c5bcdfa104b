"""Plain-torch oracle of the MoE data path over a whole world of R ranks, in one process.

Legend: T tokens on a rank, K top-k, E experts, R ranks, L = E / R local experts,
H hidden size, F expert intermediate size, M expert-major rows received by a rank.

Everything here favours obviousness over speed: loops over ranks and experts, fp32 math
(float64 inputs keep float64: the gradient checks of :mod:`ray_ep.nn` differentiate it).
Backends and kernels are checked against these functions; the library itself never calls
them (only ``check``, whose job is comparing with this oracle). Its fp8 and nvfp4 roundings
are written here again on purpose, apart from :mod:`ray_ep.fp8` and :mod:`ray_ep.nvfp4`, so
the two check each other.

Conventions shared with the kernels:
- topk ids are global expert ids; ``-1`` marks an unused slot (that slot is skipped).
- expert e lives on rank ``e // L`` as local expert ``e % L``.
- a token goes once to each rank that holds any of its experts; on the receiver it
  appears once per local expert in the expert-major layout.
- inside one local expert's segment, rows are ordered by (source rank, source token);
  each segment is padded with unused rows to a multiple of ``expert_alignment``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import E2M1_MAX, FP8_GROUP, FP8_MAX, NVFP4_BLOCK, NVFP4_GLOBAL_SCALE, EPConfig
from .weights import ExpertWeights

# |out - ref| / max|ref| a layer may show against this oracle (EPCluster.check, the GPU suite):
# the output is bf16 (2^-8 relative per rounding) and passes through several roundings (GEMM
# outputs, activation, partial sums on the wire) that the kernels may place differently from
# the reference; fp32 combine leaves only the bf16 expert activations.
TOLERANCE = {"bf16": 3e-2, "fp32": 1e-2}
# fp8 expert weights, whatever the combine dtype: the kernels sum each K block in another order
# than the reference's fp32 matmul, and where that tips a bf16 rounding of the gate_up output
# the SwiGLU value, quantised to e4m3, lands on the next step (2^-3 of it): a few elements a
# few percent of the largest output
FP8_EXPERTS_TOLERANCE = 5e-2


def check_tolerance(cfg: EPConfig) -> float:
    """The largest relative error a layer of ``cfg`` may show against this oracle."""
    return FP8_EXPERTS_TOLERANCE if cfg.expert_dtype == "fp8" else TOLERANCE[cfg.combine_dtype]


# ---- fp8 -----------------------------------------------------------------------------------
def quantize_fp8(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 e4m3 with one fp32 scale per 128 channels.

    ``scale = amax / 448`` of each group (1 where the group is all zero) and
    ``q = fp8(x * (448 / amax))``, rounded to nearest even. Returns q [T, H] float8_e4m3fn and
    scales [T, H / 128] fp32; ``q * scale`` gives x back within fp8 precision.
    """
    T, H = x_TH.shape
    g = x_TH.float().reshape(T, H // FP8_GROUP, FP8_GROUP)
    amax = g.abs().amax(dim=-1)
    nonzero = amax > 0
    safe = torch.where(nonzero, amax, 1.0)
    # tensor / tensor: IEEE division as in the kernel (a Python scalar numerator would make
    # torch multiply by a reciprocal, which rounds differently)
    fp8_max = torch.full_like(safe, FP8_MAX)
    inv = torch.where(nonzero, fp8_max / safe, 1.0)
    scales = torch.where(nonzero, safe / fp8_max, 1.0)
    q = (g * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(T, H), scales


def dequantize_fp8(q_TH: torch.Tensor, scales_TG: torch.Tensor) -> torch.Tensor:
    """fp32 values of fp8 rows with per-128-channel scales."""
    T, H = q_TH.shape
    g = q_TH.float().reshape(T, H // FP8_GROUP, FP8_GROUP) * scales_TG.float()[..., None]
    return g.reshape(T, H)


def dequantize_fp8_blocks(q_DO: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of fp8 weights [..., D, O] with one scale per 128 x 128 block
    [..., D / 128, O / 128]: ``q * scale``."""
    s = scales.float().repeat_interleave(FP8_GROUP, dim=-2).repeat_interleave(FP8_GROUP, dim=-1)
    return q_DO.float() * s


# ---- nvfp4 ---------------------------------------------------------------------------------
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)  # by code


def quantize_nvfp4(x_TH: torch.Tensor, global_scale: float = NVFP4_GLOBAL_SCALE) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4: e2m1 values, one e4m3 scale per 16 channels, per-tensor fp32 scale ``g``.

    Per block: ``s = e4m3(amax / (6 g))`` (saturating at 448), then each value's magnitude
    ``|x| * (1 / (s g))`` goes to the nearest e2m1 grid point at most 6, a tie to the point
    with the even code; the sign bit of x is the code's bit 3. Returns q [T, H / 2] uint8
    (channel 2i in the low nibble of byte i) and scales [T, H / 16] float8_e4m3fn.
    """
    T, H = x_TH.shape
    b = x_TH.float().reshape(T, H // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = b.abs().amax(dim=-1)
    g = torch.full_like(amax, global_scale)
    six = torch.full_like(amax, E2M1_MAX)
    scales = (amax / (six * g)).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    d = scales.float() * g
    # tensor / tensor for the IEEE reciprocal, as the kernel (0 where the scale is 0)
    inv = torch.where(d > 0, torch.ones_like(d) / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    v = (b.abs() * inv[..., None]).double().clamp(max=E2M1_MAX)  # in [0, 6]: distances exact in fp64
    dist = (v[..., None] - E2M1_GRID).abs()
    nearest = dist == dist.min(dim=-1, keepdim=True).values  # one point, or two at a tie
    even = nearest & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1), even.double().argmax(-1), nearest.double().argmax(-1))
    code = code + 8 * torch.signbit(b).long()
    pairs = code.reshape(T, H // 2, 2)
    return (pairs[..., 0] + 16 * pairs[..., 1]).to(torch.uint8), scales


def dequantize_nvfp4(q_TP: torch.Tensor, scales_TB: torch.Tensor,
                     global_scale: float = NVFP4_GLOBAL_SCALE) -> torch.Tensor:
    """fp32 values [T, H] of nvfp4 rows: ``e2m1(code) * (s * g)``."""
    T, P = q_TP.shape
    q = q_TP.long()
    code = torch.stack([q % 16, q // 16], dim=-1).reshape(T, 2 * P)
    sign = torch.where(code >= 8, -1.0, 1.0)
    v = (E2M1_GRID.float()[code % 8] * sign).reshape(T, 2 * P // NVFP4_BLOCK, NVFP4_BLOCK)
    d = scales_TB.float() * torch.full(scales_TB.shape, global_scale)
    return (v * d[..., None]).reshape(T, 2 * P)


# ---- experts -------------------------------------------------------------------------------
def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or float64 for float64 inputs (fp8 and bf16 accumulate in fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def swiglu_expert(x_MH: torch.Tensor, w_gate_up_HF2: torch.Tensor, w_down_FH: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert with the roundings of the kernels: bf16 operands, fp32 accumulation,
    bf16 between the stages. Returns [M, H] in the weights' dtype."""
    dt = w_down_FH.dtype
    acc = _acc(dt)
    h = (x_MH.to(acc) @ w_gate_up_HF2.to(acc)).to(dt).to(acc)
    Fi = w_down_FH.shape[0]
    a = (F.silu(h[:, :Fi]) * h[:, Fi:]).to(dt)
    return (a.to(acc) @ w_down_FH.to(acc)).to(dt)


def swiglu_expert_fp8(x_q: torch.Tensor, x_scales: torch.Tensor, w_gate_up: torch.Tensor,
                      w_gate_up_scales: torch.Tensor, w_down: torch.Tensor, w_down_scales: torch.Tensor
                      ) -> torch.Tensor:
    """One SwiGLU expert with fp8 weights (128 x 128 block scales) and the roundings of the
    kernels: the input rows as fp8 with one scale per 128 channels, fp32 products and sums,
    bf16 h, fp32 ``silu(gate) * up`` quantised to fp8 per 128 channels (never rounded to bf16
    first), bf16 output [M, H]."""
    x = dequantize_fp8(x_q, x_scales)
    h = (x @ dequantize_fp8_blocks(w_gate_up, w_gate_up_scales)).to(torch.bfloat16).float()
    Fi = w_down.shape[0]
    a_q, a_s = quantize_fp8(F.silu(h[:, :Fi]) * h[:, Fi:])
    return (dequantize_fp8(a_q, a_s) @ dequantize_fp8_blocks(w_down, w_down_scales)).to(torch.bfloat16)


# ---- dispatch / combine over a world -------------------------------------------------------
@dataclass(frozen=True)
class RankDispatch:
    """What one rank holds after dispatch, laid out expert-major.

    ``x`` [M, H] rows in the dispatch format (bf16, or fp8 with ``scales`` [M, H/128]), or
    for nvfp4 [M, H/2] packed codes with ``scales`` [M, H/16] e4m3; unused padding rows are
    zero. ``row_offsets`` [L+1] int32: rows of local expert i are
    ``row_offsets[i]:row_offsets[i+1]``. ``num_tokens`` [L] int32: real rows per expert (the
    rest of a segment is padding). ``src_info`` [M, 3] int32: (source rank, source token,
    top-k slot) of each row, -1 for padding.
    """

    x: torch.Tensor
    scales: torch.Tensor | None
    row_offsets: torch.Tensor
    num_tokens: torch.Tensor
    src_info: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        """Rows as fp32 (dequantised for fp8 and nvfp4; float64 rows stay float64)."""
        if self.x.dtype == torch.uint8:
            return dequantize_nvfp4(self.x, self.scales)
        return dequantize_fp8(self.x, self.scales) if self.scales is not None else self.x.to(_acc(self.x.dtype))


def _check_world(cfg: EPConfig, xs: list[torch.Tensor], topk_ids: list[torch.Tensor]) -> None:
    if len(xs) != cfg.world_size or len(topk_ids) != cfg.world_size:
        raise ValueError(f"need one input per rank ({cfg.world_size}), got {len(xs)} and {len(topk_ids)}")


def dispatch_world(cfg: EPConfig, xs: list[torch.Tensor], topk_ids: list[torch.Tensor]) -> list[RankDispatch]:
    """Dispatch the tokens of every rank; element r is what rank r receives.

    ``xs[r]`` [T_r, H] bf16, ``topk_ids[r]`` [T_r, K] int32. fp8 dispatch quantises each
    token once on its source rank, nvfp4 dispatch too (with the fixed global scale).
    """
    _check_world(cfg, xs, topk_ids)
    R, L, A = cfg.world_size, cfg.experts_per_rank, cfg.expert_alignment
    quantize = {"fp8": quantize_fp8, "nvfp4": quantize_nvfp4}.get(cfg.dispatch_dtype)
    sent = [quantize(x) if quantize else (x, None) for x in xs]
    out = []
    for dst in range(R):
        rows: list[list[tuple[int, int, int]]] = [[] for _ in range(L)]  # per local expert
        for src in range(R):
            ids = topk_ids[src].tolist()
            for t, row in enumerate(ids):
                for k, e in enumerate(row):
                    if e >= 0 and e // L == dst:
                        rows[e % L].append((src, t, k))
        counts = [len(r) for r in rows]
        padded = [-(-c // A) * A for c in counts]
        offsets = [0]
        for p in padded:
            offsets.append(offsets[-1] + p)
        M = offsets[-1]
        H = cfg.hidden_size
        if cfg.dispatch_dtype == "nvfp4":
            x = torch.zeros(M, H // 2, dtype=torch.uint8)
            scales = torch.zeros(M, H // NVFP4_BLOCK, dtype=torch.uint8).view(torch.float8_e4m3fn)
        else:
            x = torch.zeros(M, H, dtype=sent[0][0].dtype if sent else torch.bfloat16)
            scales = torch.zeros(M, H // FP8_GROUP, dtype=torch.float32) if quantize else None
        src_info = torch.full((M, 3), -1, dtype=torch.int32)
        for e in range(L):
            for i, (src, t, k) in enumerate(sorted(rows[e])):
                m = offsets[e] + i
                x[m] = sent[src][0][t]
                if quantize:
                    scales[m] = sent[src][1][t]
                src_info[m] = torch.tensor([src, t, k], dtype=torch.int32)
        out.append(RankDispatch(x, scales, torch.tensor(offsets, dtype=torch.int32),
                                torch.tensor(counts, dtype=torch.int32), src_info))
    return out


def experts_world(cfg: EPConfig, dispatched: list[RankDispatch], weights: ExpertWeights) -> list[torch.Tensor]:
    """Run every rank's local experts over its expert-major rows; padding rows give 0."""
    L = cfg.experts_per_rank
    ys = []
    for rank, d in enumerate(dispatched):
        local = weights.local(rank, L)
        if weights.fp8:
            # fp8 rows enter the GEMM as they are; other rows are quantised per 128 channels
            # (before the GEMM, bit for bit as fp8 dispatch would have)
            if d.x.dtype == torch.float8_e4m3fn:
                x_q, x_s = d.x, d.scales
            else:
                x_q, x_s = quantize_fp8(d.dequantized().to(torch.bfloat16))
            dt = torch.bfloat16
        else:
            x = d.dequantized().to(weights.w_down.dtype)
            dt = weights.w_down.dtype
        y = torch.zeros(d.x.shape[0], cfg.hidden_size, dtype=dt)
        for e in range(L):
            a = int(d.row_offsets[e])
            b = a + int(d.num_tokens[e])
            if b > a and weights.fp8:
                y[a:b] = swiglu_expert_fp8(x_q[a:b], x_s[a:b], local.w_gate_up[e], local.w_gate_up_scales[e],
                                           local.w_down[e], local.w_down_scales[e])
            elif b > a:
                y[a:b] = swiglu_expert(x[a:b], local.w_gate_up[e], local.w_down[e])
        ys.append(y)
    return ys


def combine_world(cfg: EPConfig, ys: list[torch.Tensor], dispatched: list[RankDispatch],
                topk_weights: list[torch.Tensor], num_tokens: list[int],
                out_dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Return every expert output row to its source token: ``out[t] = sum_k w[t, k] * y[t, k]``
    in fp32, cast to ``out_dtype``. ``ys[r]`` [M_r, H] are rank r's expert outputs in its
    expert-major order; ``num_tokens[r]`` is T_r."""
    dt = _acc(ys[0].dtype) if ys else torch.float32
    acc = [torch.zeros(n, cfg.hidden_size, dtype=dt) for n in num_tokens]
    for y, d in zip(ys, dispatched):
        for m, (src, t, k) in enumerate(d.src_info.tolist()):
            if src >= 0:
                acc[src][t] += topk_weights[src][t, k].to(dt) * y[m].to(dt)
    return [a.to(out_dtype) for a in acc]


def shared_experts(x_TH: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
    """Sum of the shared experts over a rank's own tokens, fp32 (float64 for float64 weights).
    fp8 shared experts take the tokens as bf16 rows quantised per 128 channels, as fp8 routed
    experts take bf16 dispatch's rows."""
    dt = _acc(weights.shared_down.dtype)
    out = torch.zeros(x_TH.shape, dtype=dt)
    if weights.shared_fp8 and weights.shared_down.shape[0]:
        x_q, x_s = quantize_fp8(x_TH.to(torch.bfloat16))
    for s in range(weights.shared_down.shape[0]):
        if weights.shared_fp8:
            y = swiglu_expert_fp8(x_q, x_s, weights.shared_gate_up[s], weights.shared_gate_up_scales[s],
                                  weights.shared_down[s], weights.shared_down_scales[s])
        else:
            y = swiglu_expert(x_TH, weights.shared_gate_up[s], weights.shared_down[s])
        out = out + y.to(dt)
    return out


def moe_forward(cfg: EPConfig, xs: list[torch.Tensor], topk_ids: list[torch.Tensor],
                    topk_weights: list[torch.Tensor], weights: ExpertWeights) -> list[torch.Tensor]:
    """A whole MoE layer on every rank: dispatch, routed experts, combine, plus shared experts."""
    d = dispatch_world(cfg, xs, topk_ids)
    ys = experts_world(cfg, d, weights)
    acc = _acc(weights.w_down.dtype)
    outs = combine_world(cfg, ys, d, topk_weights, [x.shape[0] for x in xs], out_dtype=acc)
    return [(o + shared_experts(x, weights)).to(x.dtype) for o, x in zip(outs, xs)]
