"""Input checks, in one place: every message names the argument, what it got and what to change.

Two levels, each run once per call:

- :func:`validate_moe_inputs` / :func:`validate_router_logits`: what a user hands to an MoE
  layer (driver, worker, communicator entry points). They look at the values (id range,
  distinct experts, finite numbers), which costs a host sync, so they run only at the entry
  the user called; inner calls pass ``validate=False``.
- :func:`check_send_inputs` and :func:`check_tensor`: the exact tensor contract of a kernel
  launcher (dtype, shape, device, strides). Metadata only, no sync: the launchers always run
  them, since a wrong shape would let a kernel write past a buffer.

Legend: T tokens on a rank, H hidden size, K top-k, E experts.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .config import EPConfig
from .errors import EPInputError

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# what a dispatch send takes, by dispatch dtype: the rows' own format, or any of X_DTYPES for
# fp8 (quantised inside the send)
# fp8 and nvfp4 quantise inside the send, so they take any float row
SEND_DTYPES = {"bf16": (torch.bfloat16,), "fp8": X_DTYPES, "nvfp4": X_DTYPES, "fp32": (torch.float32,),
               "fp64": (torch.float64,)}
# router weights travel in fp32 (meta rows), in fp64 beside fp64 rows
ROUTER_WEIGHT_DTYPE = {"bf16": torch.float32, "fp8": torch.float32, "nvfp4": torch.float32, "fp32": torch.float32,
                       "fp64": torch.float64}


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


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
    check_dense(name, t)  # after the device: a meta tensor is first of all on the wrong device
    if contiguous and not t.is_contiguous():
        raise EPInputError(f"{name} must be contiguous (call .contiguous())")
    if inner_contiguous and t.dim() >= 1 and t.numel() and t.stride(-1) != 1:
        raise EPInputError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def check_dense(name: str, t: object) -> None:
    """A real tensor with values: not a meta tensor (no data), not sparse (the kernels read
    strided memory)."""
    if not isinstance(t, torch.Tensor):
        raise EPInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_meta:
        raise EPInputError(f"{name} is a meta tensor (shape only, no data); pass a tensor with values")
    if t.layout != torch.strided:
        raise EPInputError(f"{name} has layout {t.layout}; pass a dense tensor (call .to_dense())")


def check_token_count(cfg: EPConfig, T: int, who: str = "") -> None:
    if T > cfg.max_tokens_per_rank:
        raise EPInputError(f"{who}{T} tokens exceed max_tokens_per_rank = {cfg.max_tokens_per_rank}; "
                           f"split the batch or raise max_tokens_per_rank")


def validate_moe_inputs(cfg: EPConfig, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor,
                        topk_weights_TK: torch.Tensor, rank: int | None = None) -> None:
    """Raise EPInputError for anything an MoE layer cannot take: shapes, dtypes, ids outside
    [0, E) other than -1, an expert listed twice by one token, NaN/Inf in x or the weights.
    Any device; syncs with it (the value checks)."""
    who = f"rank {rank}: " if rank is not None else ""
    for name, t in (("x", x_TH), ("topk_ids", topk_ids_TK), ("topk_weights", topk_weights_TK)):
        if isinstance(t, torch.Tensor):
            try:
                check_dense(name, t)
            except EPInputError as e:
                raise EPInputError(f"{who}{e}") from None
    if not isinstance(x_TH, torch.Tensor) or x_TH.dim() != 2 or x_TH.shape[1] != cfg.hidden_size:
        raise EPInputError(f"{who}x must be [T, hidden_size={cfg.hidden_size}], got {_shape(x_TH)}")
    T = x_TH.shape[0]
    check_token_count(cfg, T, who)
    fp64 = (torch.float64,) if cfg.dispatch_dtype == "fp64" else ()  # fp64 rows: gradient checks
    if x_TH.dtype not in X_DTYPES + fp64:
        raise EPInputError(f"{who}x must be bf16, fp16 or fp32{' or fp64' if fp64 else ''}, got {x_TH.dtype}")
    for name, t, dtypes in (("topk_ids", topk_ids_TK, ID_DTYPES),
                            ("topk_weights", topk_weights_TK, WEIGHT_DTYPES + fp64)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (T, cfg.top_k):
            raise EPInputError(f"{who}{name} must be [T={T}, top_k={cfg.top_k}], got {_shape(t)}")
        if t.dtype not in dtypes:
            raise EPInputError(f"{who}{name} has dtype {t.dtype}; use one of {[str(d) for d in dtypes]}")
    if not T:
        return
    lo, hi = int(topk_ids_TK.min()), int(topk_ids_TK.max())
    if lo < -1 or hi >= cfg.n_experts:
        raise EPInputError(f"{who}topk_ids must lie in [0, n_experts={cfg.n_experts}) or be -1 (unused), "
                           f"found values in [{lo}, {hi}]")
    ids = topk_ids_TK.long()
    used = ids >= 0
    same = (ids[:, :, None] == ids[:, None, :]) & used[:, :, None] & used[:, None, :]
    if int(same.sum()) != int(used.sum()):
        raise EPInputError(f"{who}a token lists the same expert twice in topk_ids; experts must be distinct")
    if not bool(torch.isfinite(topk_weights_TK.float()).all()):
        raise EPInputError(f"{who}topk_weights contain NaN or Inf")
    if not bool(torch.isfinite(x_TH.float()).all()):
        raise EPInputError(f"{who}x contains NaN or Inf")


def validate_router_logits(cfg: EPConfig, x_TH: object, router_logits_TE: object, rank: int | None = None) -> None:
    """Raise EPInputError unless ``router_logits_TE`` is [T, E] for the tokens of ``x_TH``."""
    who = f"rank {rank}: " if rank is not None else ""
    if not isinstance(x_TH, torch.Tensor) or x_TH.dim() != 2:
        raise EPInputError(f"{who}x must be [T, hidden_size={cfg.hidden_size}], got {_shape(x_TH)}")
    E = cfg.n_experts
    lg = router_logits_TE
    if not isinstance(lg, torch.Tensor) or lg.dim() != 2 or lg.shape[1] != E or lg.shape[0] != x_TH.shape[0]:
        raise EPInputError(f"{who}router_logits must be [T={x_TH.shape[0]}, n_experts={E}], got {_shape(lg)}")
    if lg.numel() and not bool(torch.isfinite(lg.float()).all()):
        raise EPInputError(f"{who}router_logits contain NaN or Inf")


def validate_per_rank(world_size: int, **lists: object) -> None:
    """Raise EPInputError unless every keyword is a list or tuple with one entry per rank."""
    for name, v in lists.items():
        if not isinstance(v, (list, tuple)) or len(v) != world_size:
            got = len(v) if isinstance(v, (list, tuple)) else type(v).__name__
            raise EPInputError(f"{name} must be a list with one tensor per rank ({world_size}), got {got}")


def check_send_inputs(cfg: EPConfig, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor,
                      topk_weights_TK: torch.Tensor, device: torch.device) -> None:
    """Raise EPInputError unless the tensors are what a dispatch send of ``cfg`` takes on
    ``device`` (metadata only, no sync): x_TH [T, H] bf16 (fp8 and nvfp4 dispatch also take
    fp16/fp32: they quantise inside the send; fp32 / fp64 dispatch takes that dtype), topk_ids_TK [T, K]
    int32, topk_weights_TK [T, K] fp32 (fp64 with fp64 dispatch), each with a contiguous last
    dimension."""
    want = SEND_DTYPES[cfg.dispatch_dtype]
    check_tensor("x_TH", x_TH, dims=2, dtypes=want, device=device, inner_contiguous=True)
    T = x_TH.shape[0]
    if x_TH.shape[1] != cfg.hidden_size:
        raise EPInputError(f"x_TH has {x_TH.shape[1]} channels, config hidden_size is {cfg.hidden_size}")
    check_token_count(cfg, T)
    check_tensor("topk_ids_TK", topk_ids_TK, shape=(T, cfg.top_k), dtypes=(torch.int32,), device=device,
                 inner_contiguous=True)
    check_tensor("topk_weights_TK", topk_weights_TK, shape=(T, cfg.top_k),
                 dtypes=(ROUTER_WEIGHT_DTYPE[cfg.dispatch_dtype],),
                 device=device, inner_contiguous=True)
