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


@dataclass(frozen=True)
class ExpertScratch:
    """Intermediate buffers of the expert compute, allocated once per rank (capacity rows)."""

    h_M2F: torch.Tensor
    a_MF: torch.Tensor
    y_MH: torch.Tensor

    @classmethod
    def allocate(cls, cfg: EPConfig, device: torch.device | str) -> "ExpertScratch":
        M, Fi, H = cfg.max_recv_rows, cfg.intermediate_size, cfg.hidden_size
        return cls(torch.zeros(M, 2 * Fi, dtype=torch.bfloat16, device=device),
                   torch.zeros(M, Fi, dtype=torch.bfloat16, device=device),
                   torch.zeros(M, H, dtype=torch.bfloat16, device=device))


def run_experts(*, handle: DispatchHandle, experts: LocalExperts, scratch: ExpertScratch,
                num_sms: int | None = None) -> torch.Tensor:
    """Routed experts of this rank over a dispatch; returns y_MH (expert-major, scratch.y_MH).

    Row m of expert e: ``y[m] = (silu(x @ Wg) * (x @ Wu)) @ Wd`` with x the dispatched row
    (dequantised from fp8 inside the first GEMM); padding rows are not computed.
    """
    on_gpu = handle.x_rows.device.type == "cuda"
    gemm = grouped_gemm if on_gpu else grouped_gemm_torch
    act = swiglu if on_gpu else swiglu_torch
    r = handle.recv
    gemm(a=handle.x_rows, a_scales=handle.scales_rows, a_row_ids=r.row_ids_M, b_LDO=experts.w_gate_up_LHF2,
         row_offsets_L1=r.row_offsets_L1, num_tokens_L=r.num_tokens_L, out=scratch.h_M2F, num_sms=num_sms)
    act(h_M2F=scratch.h_M2F, row_ids_M=r.row_ids_M, total_rows=r.row_offsets_L1[-1:], out=scratch.a_MF)
    gemm(a=scratch.a_MF, b_LDO=experts.w_down_LFH, row_offsets_L1=r.row_offsets_L1, num_tokens_L=r.num_tokens_L,
         out=scratch.y_MH, num_sms=num_sms)
    return scratch.y_MH


def run_experts_torch(*, handle: DispatchHandle, experts: LocalExperts, scratch: ExpertScratch,
                    num_sms: int | None = None) -> torch.Tensor:
    """Torch twin of :func:`run_experts`."""
    r = handle.recv
    grouped_gemm_torch(a=handle.x_rows, a_scales=handle.scales_rows, a_row_ids=r.row_ids_M,
                     b_LDO=experts.w_gate_up_LHF2, row_offsets_L1=r.row_offsets_L1, num_tokens_L=r.num_tokens_L,
                     out=scratch.h_M2F)
    swiglu_torch(h_M2F=scratch.h_M2F, row_ids_M=r.row_ids_M, total_rows=r.row_offsets_L1[-1:], out=scratch.a_MF)
    grouped_gemm_torch(a=scratch.a_MF, b_LDO=experts.w_down_LFH, row_offsets_L1=r.row_offsets_L1,
                     num_tokens_L=r.num_tokens_L, out=scratch.y_MH)
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
