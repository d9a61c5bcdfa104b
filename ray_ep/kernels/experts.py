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

from ..config import EPConfig
from ..errors import EPInputError
from ..types import DispatchHandle
from .activation import swiglu, swiglu_torch
from .grouped_gemm import grouped_gemm, grouped_gemm_torch


@dataclass(frozen=True)
class LocalExperts:
    """One rank's expert weights on its device (bf16).

    ``w_gate_up_LHF2`` [L, H, 2F] (gate | up), ``w_down_LFH`` [L, F, H]; shared experts
    ``shared_gate_up_SHF2`` [S, H, 2F] and ``shared_down_SFH`` [S, F, H] (S may be 0).
    """

    w_gate_up_LHF2: torch.Tensor
    w_down_LFH: torch.Tensor
    shared_gate_up_SHF2: torch.Tensor
    shared_down_SFH: torch.Tensor

    def check(self, cfg: EPConfig) -> None:
        L, H, Fi, S = cfg.experts_per_rank, cfg.hidden_size, cfg.intermediate_size, cfg.n_shared_experts
        want = {"w_gate_up_LHF2": (L, H, 2 * Fi), "w_down_LFH": (L, Fi, H),
                "shared_gate_up_SHF2": (S, H, 2 * Fi), "shared_down_SFH": (S, Fi, H)}
        for name, shape in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != torch.bfloat16:
                raise EPInputError(f"{name} must be bf16 {shape} for this config, got {t.dtype} {tuple(t.shape)}")


@dataclass
class ExpertScratch:
    """Intermediate buffers of the expert compute, allocated once per rank.

    On GPUs (and by default) at capacity (``max_recv_rows``): the kernels read the row
    counts on the device, so no host sync and CUDA graphs work. CPU workers allocate it by
    the rows that arrive instead (``rows=0``, then :meth:`ensure_rows` grows it to the most
    rows seen): at a large max_tokens_per_rank a capacity scratch is gigabytes of host memory
    for a handful of tokens (1.3 GB at 262144 tokens per rank with the tiny preset)."""

    h_M2F: torch.Tensor
    a_MF: torch.Tensor
    y_MH: torch.Tensor

    @classmethod
    def allocate(cls, cfg: EPConfig, device: torch.device | str, rows: int | None = None) -> "ExpertScratch":
        """``rows`` rows (None: capacity, max_recv_rows)."""
        M, Fi, H = cfg.max_recv_rows if rows is None else rows, cfg.intermediate_size, cfg.hidden_size
        return cls(torch.zeros(M, 2 * Fi, dtype=torch.bfloat16, device=device),
                   torch.zeros(M, Fi, dtype=torch.bfloat16, device=device),
                   torch.zeros(M, H, dtype=torch.bfloat16, device=device))

    @property
    def rows(self) -> int:
        return self.y_MH.shape[0]

    def ensure_rows(self, rows: int) -> None:
        """Grow (never shrink) to at least ``rows`` rows; new rows are zero."""
        if rows > self.rows:
            dev, Fi, H = self.y_MH.device, self.a_MF.shape[1], self.y_MH.shape[1]
            self.h_M2F = torch.zeros(rows, 2 * Fi, dtype=torch.bfloat16, device=dev)
            self.a_MF = torch.zeros(rows, Fi, dtype=torch.bfloat16, device=dev)
            self.y_MH = torch.zeros(rows, H, dtype=torch.bfloat16, device=dev)


def run_experts(*, handle: DispatchHandle, experts: LocalExperts, scratch: ExpertScratch,
                num_sms: int | None = None) -> torch.Tensor:
    """Routed experts of this rank over a dispatch; returns y_MH (expert-major, scratch.y_MH).

    Row m of expert e: ``y[m] = (silu(x @ Wg) * (x @ Wu)) @ Wd`` with x the dispatched row
    (dequantised from fp8 inside the first GEMM); padding rows are not computed.
    """
    on_gpu = handle.x_rows.device.type == "cuda"
    if not on_gpu:
        return run_experts_torch(handle=handle, experts=experts, scratch=scratch)
    gemm, act = grouped_gemm, swiglu
    r = handle.recv
    gemm(a=handle.x_rows, a_scales=handle.scales_rows, a_row_ids=r.row_ids_M, b_LDO=experts.w_gate_up_LHF2,
         row_offsets_L1=r.row_offsets_L1, num_tokens_L=r.num_tokens_L, out=scratch.h_M2F, num_sms=num_sms)
    act(h_M2F=scratch.h_M2F, row_ids_M=r.row_ids_M, total_rows=r.row_offsets_L1[-1:], out=scratch.a_MF)
    gemm(a=scratch.a_MF, b_LDO=experts.w_down_LFH, row_offsets_L1=r.row_offsets_L1, num_tokens_L=r.num_tokens_L,
         out=scratch.y_MH, num_sms=num_sms)
    return scratch.y_MH


def run_experts_torch(*, handle: DispatchHandle, experts: LocalExperts, scratch: ExpertScratch,
                    num_sms: int | None = None) -> torch.Tensor:
    """Torch twin of :func:`run_experts`, over the rows that arrived only (it reads their
    count on the host: free on a CPU); a smaller scratch grows to them. Returns the whole
    scratch.y_MH (rows past the count untouched)."""
    r = handle.recv
    n = int(r.row_offsets_L1[-1])
    scratch.ensure_rows(max(n, 1))  # row 0 exists: the combine reads it for slots of no local expert
    h, a, y, row_ids = scratch.h_M2F[:n], scratch.a_MF[:n], scratch.y_MH[:n], r.row_ids_M[:n]
    grouped_gemm_torch(a=handle.x_rows, a_scales=handle.scales_rows, a_row_ids=row_ids,
                     b_LDO=experts.w_gate_up_LHF2, row_offsets_L1=r.row_offsets_L1, num_tokens_L=r.num_tokens_L,
                     out=h)
    swiglu_torch(h_M2F=h, row_ids_M=row_ids, total_rows=r.row_offsets_L1[-1:], out=a)
    grouped_gemm_torch(a=a, b_LDO=experts.w_down_LFH, row_offsets_L1=r.row_offsets_L1,
                     num_tokens_L=r.num_tokens_L, out=y)
    return scratch.y_MH


def shared_experts(x_TH: torch.Tensor, experts: LocalExperts) -> torch.Tensor | None:
    """Sum of the shared experts over this rank's own tokens, fp32 [T, H]; None when S = 0.

    Dense bf16 GEMMs with fp32 accumulation (cuBLAS on GPUs), rounding like the reference."""
    S = experts.shared_down_SFH.shape[0]
    if S == 0:
        return None
    Fi = experts.shared_down_SFH.shape[1]
    x = x_TH.to(torch.bfloat16)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for s in range(S):
        if x.device.type == "cuda":
            h = x @ experts.shared_gate_up_SHF2[s]
            a = (torch.nn.functional.silu(h[:, :Fi].float()) * h[:, Fi:].float()).to(torch.bfloat16)
            out += (a @ experts.shared_down_SFH[s]).float()
        else:  # CPU bf16 matmul is slow and rounds differently: upcast, as the reference does
            h = (x.float() @ experts.shared_gate_up_SHF2[s].float()).to(torch.bfloat16).float()
            a = (torch.nn.functional.silu(h[:, :Fi]) * h[:, Fi:]).to(torch.bfloat16)
            out += (a.float() @ experts.shared_down_SFH[s].float()).to(torch.bfloat16).float()
    return out
