"""A rank's expert compute over a dispatch: grouped GEMM (gate_up) -> SwiGLU -> grouped GEMM
(down), all reading the expert-major description on the device (no host sync), plus the
shared experts over the rank's own tokens.

Legend: M expert-major rows (capacity), L local experts, S shared experts, H hidden, F
expert intermediate size.

On CUDA the Triton kernels run; elsewhere their torch twins do (the CPU backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import FP8_GROUP, EPConfig
from ..errors import EPInputError
from ..types import DispatchHandle
from ..validation import check_tensor
from ..weights import ExpertWeights, check_expert_weights
from .activation import swiglu, swiglu_torch
from .grouped_gemm import fuses_swiglu, grouped_gemm, grouped_gemm_torch


@dataclass(frozen=True)
class LocalExperts:
    """One rank's expert weights on its device.

    ``w_gate_up_LHF2`` [L, H, 2F] (gate | up), ``w_down_LFH`` [L, F, H]: bf16, or fp8 e4m3 with
    ``w_gate_up_scales`` [L, H / 128, 2F / 128] and ``w_down_scales`` [L, F / 128, H / 128]
    fp32 (one scale per 128 x 128 block) and D (the reduction dim) contiguous, the K-major
    layout fp8 tensor cores read. Shared experts ``shared_gate_up_SHF2`` [S, H, 2F] and
    ``shared_down_SFH`` [S, F, H] in the same dtype and layout (S may be 0), with
    ``shared_gate_up_scales`` [S, H / 128, 2F / 128] and ``shared_down_scales`` [S, F / 128,
    H / 128] when fp8.
    """

    w_gate_up_LHF2: torch.Tensor
    w_down_LFH: torch.Tensor
    shared_gate_up_SHF2: torch.Tensor
    shared_down_SFH: torch.Tensor
    w_gate_up_scales: torch.Tensor | None = None
    w_down_scales: torch.Tensor | None = None
    shared_gate_up_scales: torch.Tensor | None = None
    shared_down_scales: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.w_gate_up_LHF2.dtype == torch.float8_e4m3fn

    @property
    def shared_sum_dtype(self) -> torch.dtype:
        """The dtype of :func:`shared_experts`' sum: one shared expert's bf16 output as it is
        (the fp32 a combine adds it in holds it exactly, without an fp32 copy of [T, H]), fp32
        over several."""
        return torch.bfloat16 if self.shared_down_SFH.shape[0] == 1 else torch.float32

    @classmethod
    def build(cls, cfg: EPConfig, weights: ExpertWeights, device: torch.device | str) -> "LocalExperts":
        """This rank's slice ``weights`` (L routed experts) on ``device`` in ``cfg.expert_dtype``
        (converted if needed: :meth:`ExpertWeights.to_expert_dtype`), checked first."""
        check_expert_weights(cfg, weights, n_routed=cfg.experts_per_rank)
        w = weights.to_expert_dtype(cfg.expert_dtype)
        if cfg.expert_dtype == "fp8":
            # K-major: [N, D, O] with D contiguous (a no-op for a checkpoint's transposed views)
            kmajor = (lambda t: t.to(device).transpose(1, 2).contiguous().transpose(1, 2))
            return cls(*(kmajor(t) for t in (w.w_gate_up, w.w_down, w.shared_gate_up, w.shared_down)),
                       *(t.to(device).contiguous() for t in (w.w_gate_up_scales, w.w_down_scales,
                                                             w.shared_gate_up_scales, w.shared_down_scales)))
        return cls(*(t.to(device) for t in (w.w_gate_up, w.w_down, w.shared_gate_up, w.shared_down)))

    def check(self, cfg: EPConfig) -> None:
        L, H, Fi, S = cfg.experts_per_rank, cfg.hidden_size, cfg.intermediate_size, cfg.n_shared_experts
        dt = torch.float8_e4m3fn if cfg.expert_dtype == "fp8" else torch.bfloat16
        want = {"w_gate_up_LHF2": ((L, H, 2 * Fi), dt), "w_down_LFH": ((L, Fi, H), dt),
                "shared_gate_up_SHF2": ((S, H, 2 * Fi), dt), "shared_down_SFH": ((S, Fi, H), dt)}
        if cfg.expert_dtype == "fp8":
            G, f32 = FP8_GROUP, torch.float32
            want.update(w_gate_up_scales=((L, H // G, 2 * Fi // G), f32), w_down_scales=((L, Fi // G, H // G), f32),
                        shared_gate_up_scales=((S, H // G, 2 * Fi // G), f32),
                        shared_down_scales=((S, Fi // G, H // G), f32))
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise EPInputError(f"{name} must be {dtype} {shape} for this config (expert_dtype "
                                   f"{cfg.expert_dtype!r}), got {got}")


@dataclass
class ExpertScratch:
    """Intermediate buffers of the expert compute, allocated once per rank. With fp8 experts
    the SwiGLU output ``a_MF`` is fp8 with ``a_scales_MG`` [M, F / 128], and rows that do not
    arrive in fp8 (bf16 or nvfp4 dispatch) are quantised once into ``x_fp8`` ([R N, H] fp8, [R N,
    H / 128] fp32: one slot per receive row) for the first GEMM (GPUs, capacity scratch only;
    elsewhere the GEMM allocates it, or its twin quantises on the fly).

    On GPUs (and by default) at capacity (``max_recv_rows``): the kernels read the row
    counts on the device, so no host sync and CUDA graphs work. CPU workers allocate it by
    the rows that arrive instead (``rows=0``, then :meth:`ensure_rows` grows it to the most
    rows seen): at a large max_tokens_per_rank a capacity scratch is gigabytes of host memory
    for a handful of tokens (1.3 GB at 262144 tokens per rank with the tiny preset)."""

    h_M2F: torch.Tensor
    a_MF: torch.Tensor
    y_MH: torch.Tensor
    a_scales_MG: torch.Tensor | None = None
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None
    region_rows: int = 0  # rows per source in the receive buffer (max_tokens_per_rank); 0: unknown

    @classmethod
    def allocate(cls, cfg: EPConfig, device: torch.device | str, rows: int | None = None) -> "ExpertScratch":
        """``rows`` rows (None: capacity, max_recv_rows)."""
        M, Fi, H = cfg.max_recv_rows if rows is None else rows, cfg.intermediate_size, cfg.hidden_size
        fp8 = cfg.expert_dtype == "fp8"
        x_fp8 = None
        if fp8 and cfg.dispatch_dtype != "fp8" and rows is None:
            n = cfg.world_size * cfg.max_tokens_per_rank  # the receive buffer's rows
            x_fp8 = (torch.zeros(n, H, dtype=torch.float8_e4m3fn, device=device),
                     torch.ones(n, H // FP8_GROUP, dtype=torch.float32, device=device))
        return cls(torch.zeros(M, 2 * Fi, dtype=torch.bfloat16, device=device),
                   torch.zeros(M, Fi, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=device),
                   torch.zeros(M, H, dtype=torch.bfloat16, device=device),
                   torch.ones(M, Fi // FP8_GROUP, dtype=torch.float32, device=device) if fp8 else None, x_fp8,
                   cfg.max_tokens_per_rank)

    @property
    def rows(self) -> int:
        return self.y_MH.shape[0]

    def ensure_rows(self, rows: int) -> None:
        """Grow (never shrink) to at least ``rows`` rows; new rows are zero."""
        if rows > self.rows:
            dev, Fi, H = self.y_MH.device, self.a_MF.shape[1], self.y_MH.shape[1]
            self.h_M2F = torch.zeros(rows, 2 * Fi, dtype=torch.bfloat16, device=dev)
            self.a_MF = torch.zeros(rows, Fi, dtype=self.a_MF.dtype, device=dev)
            self.y_MH = torch.zeros(rows, H, dtype=torch.bfloat16, device=dev)
            if self.a_scales_MG is not None:
                self.a_scales_MG = torch.ones(rows, Fi // FP8_GROUP, dtype=torch.float32, device=dev)


def run_experts(*, handle: DispatchHandle, experts: LocalExperts, scratch: ExpertScratch,
                num_sms: int | None = None) -> torch.Tensor:
    """Routed experts of this rank over a dispatch; returns y_MH (expert-major, scratch.y_MH).

    Row m of expert e: ``y[m] = (silu(x @ Wg) * (x @ Wu)) @ Wd`` with x the dispatched row
    (bf16 weights: fp8 / nvfp4 rows dequantised inside the first GEMM; fp8 weights: fp8 rows
    as they are, bf16 / nvfp4 rows quantised per 128 channels inside it, and the SwiGLU output
    quantised to fp8 for the down GEMM); padding rows are not computed.
    """
    on_gpu = handle.x_rows.device.type == "cuda"
    if not on_gpu:
        return run_experts_torch(handle=handle, experts=experts, scratch=scratch)
    return _run(grouped_gemm, swiglu, handle, experts, scratch, num_sms, None, fuse=True)


def run_experts_torch(*, handle: DispatchHandle, experts: LocalExperts, scratch: ExpertScratch,
                      num_sms: int | None = None) -> torch.Tensor:
    """Torch twin of :func:`run_experts`, over the rows that arrived only (it reads their
    count on the host: free on a CPU); a smaller scratch grows to them. Returns the whole
    scratch.y_MH (rows past the count untouched)."""
    n = int(handle.recv.row_offsets_L1[-1])
    scratch.ensure_rows(max(n, 1))  # row 0 exists: the combine reads it for slots of no local expert
    return _run(grouped_gemm_torch, swiglu_torch, handle, experts, scratch, None, n, fuse=False)


def _run(gemm, act, handle: DispatchHandle, experts: LocalExperts, scratch: ExpertScratch,
         num_sms: int | None, rows: int | None, fuse: bool) -> torch.Tensor:
    """The chain over the first ``rows`` expert-major rows (None: all of the scratch); ``fuse``:
    the SwiGLU inside the gate_up GEMM where :func:`fuses_swiglu` allows it."""
    if experts.fp8 != (scratch.a_scales_MG is not None):
        raise EPInputError("fp8 experts need the fp8 scratch (ExpertScratch.allocate of an expert_dtype 'fp8' "
                           "config) and bf16 experts the bf16 one")
    r = handle.recv
    n = slice(None) if rows is None else slice(0, rows)
    h, a, y, row_ids = scratch.h_M2F[n], scratch.a_MF[n], scratch.y_MH[n], r.row_ids_M[n]
    a_scales = scratch.a_scales_MG[n] if scratch.a_scales_MG is not None else None
    segs = dict(row_offsets_L1=r.row_offsets_L1, num_tokens_L=r.num_tokens_L)
    x_fp8 = scratch.x_fp8
    if x_fp8 is not None and x_fp8[0].shape[0] != handle.x_rows.shape[0]:
        x_fp8 = None  # a receive of another row count (a packed one): the GEMM allocates its own
    regions = None
    if scratch.region_rows and handle.x_rows.shape[0] == r.recv_counts_R.shape[0] * scratch.region_rows:
        # the receive buffer: rows to convert for the other tensor-core dtype go once each, not
        # once per local expert (a packed receive this size has every region full: the same rows)
        regions = (r.recv_counts_R, scratch.region_rows)
    gate_up = dict(a=handle.x_rows, a_scales=handle.scales_rows, a_row_ids=row_ids, b_LDO=experts.w_gate_up_LHF2,
                   b_scales=experts.w_gate_up_scales, out=h, num_sms=num_sms, fp8_rows=x_fp8, a_regions=regions, **segs)
    _gate_up_swiglu(gemm, act, gate_up, fuse, row_ids.shape[0] // r.num_tokens_L.shape[0], row_ids,
                    r.row_offsets_L1[-1:], a, a_scales)
    gemm(a=a, a_scales=a_scales, b_LDO=experts.w_down_LFH, b_scales=experts.w_down_scales, out=y, num_sms=num_sms,
         **segs)
    return scratch.y_MH


def _gate_up_swiglu(gemm, act, gate_up: dict, fuse: bool, rows_per_expert: int, row_ids_M: torch.Tensor,
                    total_rows: torch.Tensor, a: torch.Tensor, a_scales: torch.Tensor | None) -> None:
    """The gate_up GEMM (``gate_up``: its arguments) and the SwiGLU into ``a`` (``a_scales``):
    with ``fuse``, where :func:`fuses_swiglu` allows (fp8 weights on Hopper), in the GEMM's
    epilogue, its bf16 output never written; else through that output and ``act``."""
    if fuse and fuses_swiglu(a=gate_up["a"], b_LDO=gate_up["b_LDO"], rows_per_expert=rows_per_expert):
        gemm(**gate_up, swiglu_out=(a, a_scales))
    else:
        act(h_M2F=gemm(**gate_up), row_ids_M=row_ids_M, total_rows=total_rows, out=a, out_scales=a_scales)


def shared_experts(x_TH: torch.Tensor, experts: LocalExperts, out: torch.Tensor | None = None,
                   num_sms: int | None = None) -> torch.Tensor | None:
    """Sum of the shared experts over this rank's own tokens [T, H] in
    ``experts.shared_sum_dtype`` (one expert's bf16 output as it is, fp32 over several); None
    when S = 0. ``out``: a tensor of that dtype and shape to write the sum into (e.g. one
    allocated on the stream that reads it, while this runs on another); None: a new one.
    ``num_sms``: the fp8 GEMMs' persistent programs (None: one per SM), e.g. the SMs a
    dispatch beside them leaves.

    bf16 experts: dense bf16 GEMMs with fp32 accumulation (cuBLAS on GPUs), rounding like the
    reference; on GPUs the SwiGLU between them is :func:`ray_ep.kernels.activation.swiglu` (fp32,
    its sigmoid may differ from torch's in the last bit, as for the routed experts). fp8
    experts: the routed experts' chain (:func:`run_experts`) over one group of every token."""
    S = experts.shared_down_SFH.shape[0]
    if S == 0:
        return None
    Fi = experts.shared_down_SFH.shape[1]
    x = x_TH.to(torch.bfloat16)
    if out is None:
        out = torch.empty(x.shape, dtype=experts.shared_sum_dtype, device=x.device)
    else:
        check_tensor("out", out, shape=tuple(x.shape), dtypes=(experts.shared_sum_dtype,), device=x.device)
    if experts.shared_gate_up_scales is not None:
        return _shared_experts_fp8(x, experts, out, num_sms)
    if x.device.type == "cuda":
        # every row real: the SwiGLU kernel in one pass, where torch's ops took six over [T, 2F]
        # (one H200, deepseek-v3's shared expert over 4096 tokens, with the first expert copied
        # rather than added to zeros: 829 -> 622 us, 858 -> 708 in a second run)
        rows = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
        total = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
    for s in range(S):
        if x.device.type == "cuda":
            a = swiglu(h_M2F=x @ experts.shared_gate_up_SHF2[s], row_ids_M=rows, total_rows=total)
            if S == 1:  # straight into the bf16 sum
                torch.mm(a, experts.shared_down_SFH[s], out=out)
                continue
            y = a @ experts.shared_down_SFH[s]
        else:  # CPU bf16 matmul is slow and rounds differently: upcast, as the reference does
            h = (x.float() @ experts.shared_gate_up_SHF2[s].float()).to(torch.bfloat16).float()
            a = (torch.nn.functional.silu(h[:, :Fi]) * h[:, Fi:]).to(torch.bfloat16)
            y = (a.float() @ experts.shared_down_SFH[s].float()).to(torch.bfloat16)
        _accumulate(out, y, s)
    return out


def _accumulate(out: torch.Tensor, y: torch.Tensor, s: int) -> None:
    """Shared expert ``s``'s bf16 output ``y`` into the sum ``out``."""
    if s == 0:  # the first one as it is, not added to zeros (one pass over [T, H], not two)
        out.copy_(y)
    else:
        out += y.float()


def _shared_experts_fp8(x: torch.Tensor, experts: LocalExperts, out: torch.Tensor,
                        num_sms: int | None) -> torch.Tensor:
    """fp8 shared experts over bf16 rows ``x`` [T, H]: each is a grouped GEMM of one expert and
    T rows (the rows quantised per 128 channels inside it), the SwiGLU quantised to fp8 (in the
    gate_up GEMM's epilogue where :func:`fuses_swiglu` allows), then the down GEMM; sums into
    ``out``."""
    T, dev = x.shape[0], x.device
    if T == 0:
        return out
    gpu = dev.type == "cuda"
    gemm, act = (grouped_gemm, swiglu) if gpu else (grouped_gemm_torch, swiglu_torch)
    Fi, H = experts.shared_down_SFH.shape[1:]
    # every token a row of one group; built on the device (no host copy: CUDA graphs capture it)
    seg = dict(row_offsets_L1=torch.arange(2, dtype=torch.int32, device=dev) * T,
               num_tokens_L=torch.full((1,), T, dtype=torch.int32, device=dev), num_sms=num_sms)
    rows = torch.arange(T, dtype=torch.int32, device=dev)
    a = torch.empty(T, Fi, dtype=torch.float8_e4m3fn, device=dev)
    a_scales = torch.empty(T, Fi // FP8_GROUP, dtype=torch.float32, device=dev)
    # one expert: its output is the sum (bf16), written in place
    y = out if out.dtype == torch.bfloat16 else torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    for s in range(experts.shared_down_SFH.shape[0]):
        gate_up = dict(a=x, b_LDO=experts.shared_gate_up_SHF2[s:s + 1], b_scales=experts.shared_gate_up_scales[s:s + 1],
                       **seg)
        _gate_up_swiglu(gemm, act, gate_up, gpu, T, rows, seg["num_tokens_L"], a, a_scales)
        gemm(a=a, a_scales=a_scales, b_LDO=experts.shared_down_SFH[s:s + 1],
             b_scales=experts.shared_down_scales[s:s + 1], out=y, **seg)
        if y is not out:
            _accumulate(out, y, s)
    return out
