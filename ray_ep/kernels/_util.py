"""Launcher helpers shared by the kernel modules: input validation and launch shapes."""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch
import triton

from ..errors import EPInputError


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device; 4 stand-ins for a CPU (interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def grid_size(work_items: int, device: torch.device | str, budget: int | None) -> int:
    """Programs for a persistent launch: no more than the work, the SM budget or the SMs.

    Receive kernels spin on signals, so every program of a launch must be resident at once:
    the grid never exceeds the SM count (one program per SM).
    """
    cap = num_sms(device) if budget is None else min(budget, num_sms(device))
    return max(1, min(work_items, cap))


def tile_shape(H: int, device: torch.device | str, multiple: int = 8) -> tuple[int, int]:
    """(rows, channels) of a row-copy tile: channels a power of two >= ``multiple``, at most 1024
    (16 B per thread at 4 warps x 2 rows), and about 4K elements per tile."""
    block_h = max(multiple, min(1024, triton.next_power_of_2(H)))
    block_t = max(1, 4096 // block_h)
    if interpreted():  # numpy per op: fewer, larger ops are faster
        block_t = max(block_t, 16)
    return block_t, block_h


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Equal devices, treating 'cuda' and 'cuda:<current>' alike."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_tensor(name: str, t: object, *, dims: int | None = None, shape: Sequence[int] | None = None,
                 dtypes: Sequence[torch.dtype] | None = None, device: torch.device | str | None = None,
                 contiguous: bool = False, inner_contiguous: bool = False) -> None:
    """Raise EPInputError naming ``name`` when ``t`` is not the tensor a launcher needs."""
    if not isinstance(t, torch.Tensor):
        raise EPInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise EPInputError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise EPInputError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise EPInputError(f"{name} must be {names}, got {str(t.dtype).replace('torch.', '')}")
    if device is not None and not same_device(t.device, device):
        raise EPInputError(f"{name} must be on {torch.device(device)}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise EPInputError(f"{name} must be contiguous (call .contiguous())")
    if inner_contiguous and t.dim() >= 1 and t.numel() and t.stride(-1) != 1:
        raise EPInputError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
