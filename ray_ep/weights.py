"""Expert weights of a whole world: the container, seeded random initialisation, checks, and
loading a DeepSeek-V3 checkpoint's experts from safetensors files.

Legend: E routed experts, S shared experts, H hidden size, F expert intermediate size,
L = E / R routed experts per rank.

Routed and shared experts come in bf16 (or fp16 / fp32, converted at load) or in fp8 e4m3
with one fp32 scale per 128 x 128 block of each weight: ``weight = q * scale`` (DeepSeek-V3
ships its experts, shared ones included, this way and calls the scale ``weight_scale_inv``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Sequence

import torch

from .config import FP8_GROUP, EPConfig
from .errors import EPInputError
from .fp8 import dequantize_fp8_blocks_torch, quantize_fp8_blocks_torch

# each expert draws from its own generator seeded with seed * SEED_STRIDE + expert id, so a
# rank can build just its slice; a prime stride keeps (seed, expert) pairs from colliding
SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class ExpertWeights:
    """SwiGLU expert weights: ``y = (silu(x @ Wg) * (x @ Wu)) @ Wd`` with
    ``w_gate_up[e] = [Wg | Wu]`` of shape [H, 2F] and ``w_down[e]`` of shape [F, H].
    Routed experts are [E, ...]; shared experts [S, ...] (S may be 0).

    fp8 routed experts: ``w_gate_up`` / ``w_down`` are float8_e4m3fn (any strides: a
    checkpoint's [out, in] tensors enter as transposed views) and ``w_gate_up_scales``
    [E, H / 128, 2F / 128], ``w_down_scales`` [E, F / 128, H / 128] hold the fp32 scale of each
    128 x 128 block (``weight = q * scale``); None for float weights. fp8 shared experts
    likewise, with ``shared_gate_up_scales`` [S, H / 128, 2F / 128] and ``shared_down_scales``
    [S, F / 128, H / 128] (routed and shared experts need not share a dtype)."""

    w_gate_up: torch.Tensor  # [E, H, 2F]
    w_down: torch.Tensor  # [E, F, H]
    shared_gate_up: torch.Tensor  # [S, H, 2F]
    shared_down: torch.Tensor  # [S, F, H]
    w_gate_up_scales: torch.Tensor | None = None  # [E, H / 128, 2F / 128] fp32, fp8 only
    w_down_scales: torch.Tensor | None = None  # [E, F / 128, H / 128] fp32, fp8 only
    shared_gate_up_scales: torch.Tensor | None = None  # [S, H / 128, 2F / 128] fp32, fp8 only
    shared_down_scales: torch.Tensor | None = None  # [S, F / 128, H / 128] fp32, fp8 only

    @property
    def fp8(self) -> bool:
        """True when the routed experts are fp8 with block scales."""
        return self.w_gate_up.dtype == torch.float8_e4m3fn

    @property
    def shared_fp8(self) -> bool:
        """True when the shared experts are fp8 with block scales."""
        return self.shared_gate_up.dtype == torch.float8_e4m3fn

    def __reduce__(self):
        # torch pickles a tensor's storage through a path that has no float8 (unpickling fails
        # in the workers): fp8 tensors travel as their bytes (same strides) and are viewed back
        parts = [(t.view(torch.uint8), True) if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn
                 else (t, False) for t in (getattr(self, f.name) for f in fields(self))]
        return _rebuild_expert_weights, (parts,)

    def local(self, rank: int, experts_per_rank: int) -> "ExpertWeights":
        """The slice of routed experts that ``rank`` holds (shared experts are replicated)."""
        sl = slice(rank * experts_per_rank, (rank + 1) * experts_per_rank)
        return replace(self, w_gate_up=self.w_gate_up[sl], w_down=self.w_down[sl],
                       **{k: getattr(self, k)[sl] for k in ("w_gate_up_scales", "w_down_scales")
                          if getattr(self, k) is not None})

    def to_expert_dtype(self, expert_dtype: str) -> "ExpertWeights":
        """Routed and shared experts as ``expert_dtype`` wants them: "fp8" quantises float
        weights per 128 x 128 block (:func:`ray_ep.fp8.quantize_fp8_blocks_torch`), "bf16"
        dequantises fp8 weights and casts float ones to bf16. Unchanged tensors are not copied."""
        gu, gu_s = _as_expert_dtype(self.w_gate_up, self.w_gate_up_scales, expert_dtype)
        dn, dn_s = _as_expert_dtype(self.w_down, self.w_down_scales, expert_dtype)
        sgu, sgu_s = _as_expert_dtype(self.shared_gate_up, self.shared_gate_up_scales, expert_dtype)
        sdn, sdn_s = _as_expert_dtype(self.shared_down, self.shared_down_scales, expert_dtype)
        return ExpertWeights(gu, dn, sgu, sdn, gu_s, dn_s, sgu_s, sdn_s)


def _as_expert_dtype(w: torch.Tensor, scales: torch.Tensor | None,
                     expert_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [N, D, O] (and its block scales for fp8) in ``expert_dtype``."""
    fp8 = w.dtype == torch.float8_e4m3fn
    if expert_dtype == "fp8":
        return (w, scales) if fp8 else quantize_fp8_blocks_torch(w)
    return (dequantize_fp8_blocks_torch(w, scales) if fp8 else w.to(torch.bfloat16)), None


def _rebuild_expert_weights(parts: list) -> ExpertWeights:
    return ExpertWeights(*(t.view(torch.float8_e4m3fn) if fp8 else t for t, fp8 in parts))


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def check_expert_weights(cfg: EPConfig, w: ExpertWeights, *, n_routed: int | None = None,
                         where: str = "weights") -> None:
    """Raise EPInputError unless ``w`` holds ``n_routed`` (default E) routed experts and the
    S shared experts of ``cfg`` with the right shapes and dtypes. fp8 experts (routed or
    shared) need H and F multiples of 128 and block scales of the right shape, finite and
    positive; their values must not be NaN. Float weights are not read (no pass over them)."""
    H, Fi, S = cfg.hidden_size, cfg.intermediate_size, cfg.n_shared_experts
    E = cfg.n_experts if n_routed is None else n_routed
    kinds = {"routed": (E, "w_gate_up", "w_down", w.fp8), "shared": (S, "shared_gate_up", "shared_down", w.shared_fp8)}
    for kind, (n, gate_up, down, fp8) in kinds.items():
        for name, shape in ((gate_up, (n, H, 2 * Fi)), (down, (n, Fi, H))):
            t = getattr(w, name)
            if not isinstance(t, torch.Tensor):
                raise EPInputError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise EPInputError(f"{where}: {name} has shape {list(t.shape)}, this config needs {list(shape)}")
            allowed = (torch.float8_e4m3fn,) if fp8 else FLOAT_DTYPES
            if t.dtype not in allowed:
                raise EPInputError(f"{where}: {name} is {_dtype_name(t.dtype)}, expected "
                                   f"{' or '.join(_dtype_name(d) for d in allowed)} ({gate_up} and {down} "
                                   f"must both be fp8 or both float)")
        pairs = ((f"{gate_up}_scales", gate_up), (f"{down}_scales", down))
        if not fp8:
            given = [k for k, _ in pairs if getattr(w, k) is not None]
            if given:
                raise EPInputError(f"{where}: {', '.join(given)} given for {_dtype_name(getattr(w, gate_up).dtype)} "
                                   f"{kind} experts; block scales belong to float8_e4m3fn weights only")
            continue
        for name, size in (("hidden_size (H)", H), ("intermediate_size (F)", Fi)):
            if size % FP8_GROUP:
                raise EPInputError(f"{where}: fp8 expert weights need {name} % {FP8_GROUP} == 0 (the reduction "
                                   f"dim of a GEMM, one scale per {FP8_GROUP} x {FP8_GROUP} block), got {size}")
        for name, weight in pairs:
            _check_block_scales(getattr(w, name), getattr(w, weight), name, weight, where)


def _check_block_scales(t, q: torch.Tensor, name: str, weight: str, where: str) -> None:
    """fp32 scales ``t`` of fp8 ``q`` [N, D, O]: [N, D / 128, O / 128], finite and positive; no
    NaN code in ``q``."""
    G = FP8_GROUP
    shape = (q.shape[0], q.shape[1] // G, q.shape[2] // G)
    if t is None:
        raise EPInputError(f"{where}: fp8 {weight} needs {name} {list(shape)} fp32 (one scale per "
                           f"{G} x {G} block; DeepSeek-V3's weight_scale_inv)")
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise EPInputError(f"{where}: {name} has shape {got}, expected {list(shape)} (one scale per "
                           f"{G} x {G} block of {weight} {list(q.shape)})")
    if t.dtype != torch.float32:
        raise EPInputError(f"{where}: {name} is {_dtype_name(t.dtype)}, expected float32")
    bad = ~torch.isfinite(t) | (t <= 0)
    if bool(bad.any()):
        i = tuple(int(v) for v in bad.nonzero()[0])
        raise EPInputError(f"{where}: {name} holds a scale that is not finite and positive "
                           f"({float(t[i])} at {list(i)}); every block scale must be > 0 and finite")
    # e4m3fn's only non-finite codes are NaN: 0x7F and 0xFF
    nan = (q.view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan.any()):
        i = tuple(int(v) for v in nan.nonzero()[0])
        raise EPInputError(f"{where}: {weight} holds NaN at {list(i)}")


def init_expert_weights(cfg: EPConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                        experts: range | None = None, device: torch.device | str = "cpu",
                        draw_on_device: bool = False) -> ExpertWeights:
    """Seeded random weights, scaled so activations stay O(1) through an expert.

    Each expert draws from its own generator (seed, expert id), so a rank can build just its
    slice (``experts=range(rank * L, (rank + 1) * L)``) and match the whole world's weights.
    The draw runs on the CPU and the result moves to ``device``; ``draw_on_device`` draws on
    ``device`` instead (seconds instead of minutes for a large layer, for benchmarks), but
    those values differ from the CPU draw, so nothing can compare them with the reference.

    With ``cfg.expert_dtype == "fp8"`` the routed and shared experts are the same ``dtype``
    weights quantised per 128 x 128 block (so bf16 and fp8 layers of one seed compare).
    """
    H, Fi, E, S = cfg.hidden_size, cfg.intermediate_size, cfg.n_experts, cfg.n_shared_experts
    ids = range(E) if experts is None else experts
    fp8 = cfg.expert_dtype == "fp8"

    def one(stream: int, quantize: bool = False) -> tuple[torch.Tensor, ...]:
        where = device if draw_on_device else "cpu"
        g = torch.Generator(device=where).manual_seed(seed * SEED_STRIDE + stream)
        gate_up = (torch.randn(H, 2 * Fi, generator=g, device=where) / H**0.5).to(dtype).to(device)
        down = (torch.randn(Fi, H, generator=g, device=where) / Fi**0.5).to(dtype).to(device)
        if quantize:  # one expert at a time: the host never holds the world in fp32
            return (*quantize_fp8_blocks_torch(gate_up), *quantize_fp8_blocks_torch(down))
        return gate_up, down

    def stacked(n: int, make, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        # filled expert by expert: the peak is the layer plus one expert (a list of experts
        # then torch.stack held the layer twice: 2 x 11 GB per rank of deepseek-v3 on a host)
        out = [torch.empty(n, *shape, dtype=dt, device=device) for shape, dt in shapes]
        for i in range(n):
            for t, part in zip(out, make(i)):
                t[i] = part
        return out

    G, f8 = FP8_GROUP, torch.float8_e4m3fn
    if not fp8:
        shapes = [((H, 2 * Fi), dtype), ((Fi, H), dtype)]
        gate_up, down = stacked(len(ids), lambda i: one(ids[i]), shapes)
        shared_gate_up, shared_down = stacked(S, lambda s: one(E + s), shapes)
        return ExpertWeights(gate_up, down, shared_gate_up, shared_down)
    shapes = [((H, 2 * Fi), f8), ((H // G, 2 * Fi // G), torch.float32), ((Fi, H), f8),
              ((Fi // G, H // G), torch.float32)]
    gate_up, gate_up_s, down, down_s = stacked(len(ids), lambda i: one(ids[i], True), shapes)
    shared_gate_up, shared_gate_up_s, shared_down, shared_down_s = stacked(S, lambda s: one(E + s, True), shapes)
    return ExpertWeights(gate_up, down, shared_gate_up, shared_down, gate_up_s, down_s, shared_gate_up_s,
                         shared_down_s)


# ---- DeepSeek-V3 checkpoints ---------------------------------------------------------------
# Keys of one MoE layer in a DeepSeek-V3 / R1 checkpoint (Hugging Face layout): each
# projection is [out, in] e4m3 with ``weight_scale_inv`` [out / 128, in / 128] fp32
DEEPSEEK_PREFIX = "model.layers.{layer}.mlp."
_PROJ = "{part}.{proj}_proj.{what}"


def _safetensors_index(path: str | Path | Sequence[str | Path]) -> dict[str, Path]:
    """Tensor name -> file, for a checkpoint folder (its ``model.safetensors.index.json``, else
    every ``*.safetensors`` in it), one file, or a list of files."""
    from safetensors import safe_open

    if isinstance(path, (str, Path)) and Path(path).is_dir():
        folder = Path(path)
        index = folder / "model.safetensors.index.json"
        if index.exists():
            return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        files = sorted(folder.glob("*.safetensors"))
    else:
        files = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
    if not files:
        raise EPInputError(f"no safetensors files at {path}")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            out.update({k: f for k in st.keys()})
    return out


def load_deepseek_experts(path: str | Path | Sequence[str | Path], cfg: EPConfig, *, layer: int,
                          experts: range | None = None, prefix: str = DEEPSEEK_PREFIX) -> ExpertWeights:
    """One MoE layer's experts from a DeepSeek-V3-layout checkpoint (safetensors).

    Reads ``{prefix}experts.{e}.{gate,up,down}_proj.weight`` (and ``.weight_scale_inv`` for
    e4m3 weights) for e in ``experts`` (default: all E; a rank passes its own slice), and
    ``{prefix}shared_experts.*`` for the S shared experts, where prefix is
    ``model.layers.{layer}.mlp.``. fp8 routed experts stay fp8: gate and up stack into
    ``w_gate_up`` [E, H, 2F], a transposed view of the checkpoint's [out, in] rows (the
    K-major layout fp8 tensor cores read), and so do fp8 shared experts. Float checkpoints load
    as bf16. Checked with :func:`check_expert_weights`."""
    from safetensors import safe_open

    index = _safetensors_index(path)
    pre = prefix.format(layer=layer)
    ids = range(cfg.n_experts) if experts is None else experts
    opened: dict[Path, object] = {}

    def get(key: str) -> torch.Tensor:
        if key not in index:
            raise EPInputError(f"{path}: no tensor {key!r} in the checkpoint (layer {layer})")
        f = index[key]
        if f not in opened:
            opened[f] = safe_open(str(f), framework="pt")
        return opened[f].get_tensor(key)

    def proj(part: str, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = get(pre + _PROJ.format(part=part, proj=name, what="weight"))
        s = get(pre + _PROJ.format(part=part, proj=name, what="weight_scale_inv")) if w.dtype == torch.float8_e4m3fn \
            else None
        return w, s

    def expert(part: str) -> tuple[torch.Tensor, ...]:
        (g, gs), (u, us), (d, ds) = proj(part, "gate"), proj(part, "up"), proj(part, "down")
        fp8 = [s is not None for s in (gs, us, ds)]
        if any(fp8) and not all(fp8):
            raise EPInputError(f"{path}: layer {layer} {part}: mixed fp8 and float projections")
        if not any(fp8):
            return torch.cat([g, u]).to(torch.bfloat16).t(), d.to(torch.bfloat16).t(), None, None
        return torch.cat([g, u]).t(), d.t(), torch.cat([gs, us]).t(), ds.t()

    if cfg.n_shared_experts > 1:
        raise EPInputError(f"DeepSeek-V3 checkpoints hold one shared expert per layer (as one wide MLP); "
                           f"n_shared_experts = {cfg.n_shared_experts}")
    if not ids:
        raise EPInputError("experts must name at least one routed expert to load")
    try:
        routed = [expert(f"experts.{e}") for e in ids]
        shared = [expert("shared_experts")] if cfg.n_shared_experts else []
    finally:
        opened.clear()
    H, Fi = cfg.hidden_size, cfg.intermediate_size

    def stack(parts: list, i: int) -> torch.Tensor | None:
        if not parts or parts[0][i] is None:
            return None
        # stacking transposed views keeps them transposed ([E, D, O] with D contiguous)
        return torch.stack([p[i].t() for p in parts]).transpose(1, 2)

    empty = torch.empty(0, H, 2 * Fi, dtype=torch.bfloat16), torch.empty(0, Fi, H, dtype=torch.bfloat16)
    w = ExpertWeights(stack(routed, 0), stack(routed, 1), stack(shared, 0) if shared else empty[0],
                      stack(shared, 1) if shared else empty[1], stack(routed, 2), stack(routed, 3),
                      stack(shared, 2), stack(shared, 3))
    check_expert_weights(cfg, w, n_routed=len(ids), where=f"{path} layer {layer}")
    return w
