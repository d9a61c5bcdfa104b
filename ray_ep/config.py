"""Expert-parallel topology and buffer plan.

Legend (docs/design.md): T tokens on a rank, K top-k, E experts, R ranks (world size),
L = E / R local experts, H hidden size, F expert intermediate size, N_max max tokens per rank.

:class:`EPConfig` validates the topology before anything is started; :func:`plan_buffers`
turns it into a :class:`BufferPlan`, the byte layout of every symmetric buffer, so the
memory cost per GPU is known before anything is allocated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_GPUS_PER_NODE = 8
# a week: longer is no timeout at all, and inf or 1e300 would overflow the kernels' nanosecond clocks
MAX_TIMEOUT_S = 7 * 24 * 3600.0
FP8_GROUP = 128  # channels per fp32 scale in fp8 dispatch
FP8_MAX = 448.0  # largest finite float8_e4m3fn: the amax of each group maps onto it
NVFP4_BLOCK = 16  # channels per e4m3 block scale in nvfp4 dispatch (NVIDIA's NVFP4 block size)
E2M1_MAX = 6.0  # largest e2m1 (fp4) magnitude: each block's amax maps onto it
# The per-tensor fp32 scale of nvfp4 dispatch: fixed, so the send needs no pass over the
# whole tensor and receivers need no per-source field. With 1.0 a block's e4m3 scale
# amax / 6 keeps full precision for block amaxes from 6 * 2^-6 = 0.094 to 6 * 448 = 2688.
NVFP4_GLOBAL_SCALE = 1.0
ALIGN_BYTES = 128  # every sub-buffer starts on this boundary (16 B vector access, cache lines)

DTYPE_BYTES = {"bf16": 2, "fp8": 1, "fp32": 4, "fp64": 8, "int32": 4, "int64": 8, "u8": 1}
# wire dtypes that only the torch backend moves (the GPU kernels move bf16 / fp8 / nvfp4 rows
# and bf16 / fp32 partials): full-precision training on CPU and float64 gradient checks
TORCH_ONLY_DTYPES = {"dispatch_dtype": ("fp32", "fp64"), "combine_dtype": ("fp64",)}


def nvfp4_row_bytes(H: int) -> int:
    """Bytes of one nvfp4 wire row of H channels: H / 2 bytes of packed e2m1 codes, then the
    H / 16 e4m3 block scales, padded to 16 bytes (so every row starts 16-byte aligned).

    >>> nvfp4_row_bytes(7168), nvfp4_row_bytes(128)
    (4032, 80)
    """
    return H // 2 + -(-(H // NVFP4_BLOCK) // 16) * 16


def parse_topology(text: str) -> tuple[int, int]:
    """(n_nodes, gpus_per_node) of a topology written NODESxGPUS, e.g. "2x4".

    >>> parse_topology("2x4")
    (2, 4)
    """
    try:
        n_nodes, per_node = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a topology looks like 2x4 (NODESxGPUS), got {text!r}") from None
    if n_nodes <= 0 or per_node <= 0:
        raise ValueError(f"a topology needs at least one node and one GPU per node, got {text!r}")
    return n_nodes, per_node


class EPConfig(BaseModel):
    """Topology and sizes of one expert-parallel MoE layer group.

    >>> cfg = EPConfig(hidden_size=128, n_experts=8, top_k=2, max_tokens_per_rank=16,
    ...                intermediate_size=64, gpus_per_node=2)
    >>> cfg.world_size, cfg.experts_per_rank
    (2, 4)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(gt=0)
    """H: channels of a token row."""
    n_experts: int = Field(gt=0)
    """E: routed experts over the whole world; each rank holds E / R of them."""
    top_k: int = Field(gt=0)
    """K: experts each token is routed to (distinct)."""
    max_tokens_per_rank: int = Field(gt=0)
    """N_max: the most tokens one rank may hand to one dispatch; sizes every buffer."""
    intermediate_size: int = Field(default=256, gt=0)
    """F: inner width of each SwiGLU expert (gate and up are F wide each)."""
    n_shared_experts: int = Field(default=0, ge=0)
    """Shared experts applied to every token on its own rank, added to the combined output."""
    n_nodes: int = Field(default=1, gt=0)
    """Nodes (hosts) of the group."""
    gpus_per_node: int = Field(default=1, gt=0)
    """Ranks per node: GPUs per node, or CPU workers per node on the torch backend."""
    dispatch_dtype: Literal["bf16", "fp8", "nvfp4", "fp32", "fp64"] = "bf16"
    """Row format on the wire for dispatch: bf16; fp8 e4m3 with one fp32 scale per 128 channels;
    nvfp4: e2m1 values packed two per byte with one e4m3 scale per 16 channels (and a fixed
    per-tensor scale of 1), see :mod:`ray_ep.nvfp4`; fp32 / fp64 (backend 'torch' only) move
    rows at full precision (CPU training, gradcheck)."""
    expert_dtype: Literal["bf16", "fp8"] = "bf16"
    """Routed and shared expert weights on the device: bf16; or fp8 e4m3 with one fp32 scale per
    128 x 128 block of each weight (the DeepSeek-V3 layout), multiplied on fp8 tensor cores with
    the activations quantised per 128 channels. Given weights are converted to it at load
    (bf16 quantised per block, fp8 dequantised)."""
    combine_dtype: Literal["bf16", "fp32", "fp64"] = "bf16"
    """Row format of expert outputs on the wire for combine (fp32 for exactness checks; fp64,
    backend 'torch' only, for float64 gradient checks)."""
    combine_mode: Literal["push", "pull"] = "push"
    """How combine moves the partial rows (backend nvshmem; the torch backend ignores it).
    push: the rank that ran the experts forms each partial row (the router-weighted sum of a
    received token's local experts) and stores it in its source's buffer; ``num_sms`` covers it
    all. pull (one node only): the partial rows are formed in the rank's own buffer by a pass on
    the SMs ``num_sms`` leaves (every SM without a budget: expert-side work), each block flagged
    to its source as it is stored; each source loads its rows from the peers over NVLink and
    sums them on ``num_sms`` SMs, starting as the blocks arrive. It pays under an SM budget (4x
    H200 prefill at 24 SMs: 733 us against 1068 push; without a budget 796 against 555)."""
    expert_alignment: int = Field(default=1, gt=0)
    """Rows of each local expert's segment are padded to a multiple of this."""
    backend: Literal["auto", "nvshmem", "torch"] = "auto"
    """auto: nvshmem when every worker has a GPU, else torch (gloo on CPU)."""
    num_sms: int | None = Field(default=None, gt=0)
    """Most programs (SMs) a communication kernel may use, the dispatch's layout launches
    included; None: all of them."""
    micro_batches: int = Field(default=1, ge=1, le=8)
    """MoE layers cut each rank's tokens into this many micro-batches and overlap one's
    communication with another's experts (:mod:`ray_ep.pipeline`); each micro-batch has buffers
    of its own for ``ceil(max_tokens_per_rank / micro_batches)`` tokens. Pays with ``num_sms``
    (communication on a few SMs, the GEMMs on the rest)."""
    init_timeout_s: float = Field(default=180.0, gt=0, le=MAX_TIMEOUT_S)
    """Limit for starting workers and joining the rendezvous / NVSHMEM bootstrap."""
    recv_timeout_s: float = Field(default=30.0, gt=0, le=MAX_TIMEOUT_S)
    """Limit for a rank waiting on its peers' signals inside a receive kernel."""
    call_timeout_s: float = Field(default=600.0, gt=0, le=MAX_TIMEOUT_S)
    """Limit for one driver call on all workers (a dead or hung worker fails it)."""

    @property
    def world_size(self) -> int:
        """R = n_nodes * gpus_per_node."""
        return self.n_nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        """The node of a rank (ranks are node-major); the kernels reach ranks of their own node
        by stores over NVLink and the others by NVSHMEM puts."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        return rank // self.gpus_per_node

    @property
    def experts_per_rank(self) -> int:
        """L = E / R."""
        return self.n_experts // self.world_size

    @property
    def experts_per_token_rank(self) -> int:
        """Most of a token's K experts that can sit on one rank: min(K, L)."""
        return min(self.top_k, self.experts_per_rank)

    @property
    def max_recv_rows(self) -> int:
        """Most expert-major rows a rank can receive, padding included."""
        pad = self.experts_per_rank * (self.expert_alignment - 1)
        return self.world_size * self.max_tokens_per_rank * self.experts_per_token_rank + pad

    @model_validator(mode="before")
    @classmethod
    def _no_bools_for_numbers(cls, data: Any) -> Any:
        # pydantic would take True as 1 (a YAML `hidden_size: yes`): a number field wants a number
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and field.annotation in (int, float, int | None):
                    raise ValueError(f"{name} must be a number, got {value!r}")
        return data

    @model_validator(mode="after")
    def _check_topology(self) -> "EPConfig":
        R = self.world_size
        if self.gpus_per_node > MAX_GPUS_PER_NODE:
            raise ValueError(
                f"gpus_per_node = {self.gpus_per_node} exceeds {MAX_GPUS_PER_NODE}, the most one "
                f"NVLink domain holds; use n_nodes to add ranks"
            )
        if self.n_experts % R != 0:
            raise ValueError(
                f"n_experts (E) = {self.n_experts} must be divisible by the world size "
                f"(R = n_nodes * gpus_per_node = {self.n_nodes} * {self.gpus_per_node} = {R}); "
                f"change n_experts or the topology"
            )
        if self.top_k > self.n_experts:
            raise ValueError(
                f"top_k (K) = {self.top_k} must be <= n_experts (E) = {self.n_experts}: "
                f"a token picks K distinct experts"
            )
        if self.dispatch_dtype == "fp8" and self.hidden_size % FP8_GROUP != 0:
            raise ValueError(
                f"dispatch_dtype 'fp8' needs hidden_size % {FP8_GROUP} == 0 (one scale per "
                f"{FP8_GROUP} channels), got hidden_size = {self.hidden_size}; use bf16 or pad H"
            )
        if self.dispatch_dtype == "nvfp4" and self.hidden_size % NVFP4_BLOCK != 0:
            raise ValueError(
                f"dispatch_dtype 'nvfp4' needs hidden_size % {NVFP4_BLOCK} == 0 (one e4m3 scale per "
                f"{NVFP4_BLOCK} channels), got hidden_size = {self.hidden_size}; use bf16 or pad H"
            )
        if self.expert_dtype == "fp8":
            for name, size in (("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size)):
                if size % FP8_GROUP:
                    raise ValueError(
                        f"expert_dtype 'fp8' needs {name} % {FP8_GROUP} == 0 (it is the reduction "
                        f"dim of a GEMM with one scale per {FP8_GROUP} x {FP8_GROUP} weight block), got "
                        f"{name} = {size}; use expert_dtype 'bf16' or a multiple of {FP8_GROUP}"
                    )
        for field, dtype in (("dispatch_dtype", self.dispatch_dtype), ("combine_dtype", self.combine_dtype)):
            if dtype in TORCH_ONLY_DTYPES[field] and self.backend != "torch":
                raise ValueError(
                    f"{field} '{dtype}' is moved by the torch backend only (the GPU kernels move "
                    f"bf16 / fp8 / nvfp4 rows), got backend '{self.backend}'; set backend='torch' or use bf16"
                )
            # nvfp4: the packed values (half a byte per channel) start each wire row
            row_bytes = self.hidden_size // 2 if dtype == "nvfp4" else self.hidden_size * DTYPE_BYTES[dtype]
            multiple = 32 if dtype == "nvfp4" else 16 // DTYPE_BYTES[dtype]
            if row_bytes % 16 != 0:
                what = "the packed values of a row" if dtype == "nvfp4" else "a row"
                raise ValueError(
                    f"{what} of hidden_size = {self.hidden_size} in {field} '{dtype}' is {row_bytes} "
                    f"bytes; rows must be a multiple of 16 bytes for vector access: make "
                    f"hidden_size a multiple of {multiple}"
                )
        if self.combine_mode == "pull" and self.n_nodes > 1:
            raise ValueError(
                f"combine_mode 'pull' loads partial rows from peers over NVLink, so every rank must "
                f"be on one node; got n_nodes = {self.n_nodes}; use combine_mode 'push'"
            )
        if self.expert_alignment & (self.expert_alignment - 1):
            raise ValueError(
                f"expert_alignment = {self.expert_alignment} must be a power of two (1, 2, 4, ...)"
            )
        if self.max_recv_rows * max(self.hidden_size, 2 * self.intermediate_size) >= 2**31:
            raise ValueError(
                f"max_tokens_per_rank = {self.max_tokens_per_rank} makes the receive side "
                f"({self.max_recv_rows} rows) too large for 32-bit offsets; lower it"
            )
        return self

    # ---- construction helpers -------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "EPConfig":
        """A named preset (see :data:`PRESETS`) with field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides: Any) -> "EPConfig":
        """From a mapping of fields; a key ``preset`` starts from that preset."""
        data = dict(data)
        name = data.pop("preset", None)
        merged = {**data, **overrides}
        return cls.preset(name, **merged) if name else cls(**merged)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "EPConfig":
        """From a YAML or JSON file of fields (optionally under a top-level ``ep:`` key)."""
        text = Path(path).read_text()
        if str(path).endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
        if isinstance(data, dict) and "ep" in data:
            # other top-level sections belong to other tools (a Ray job's check: / bench:), but an
            # EPConfig field beside ep: would be dropped without a word
            stray = sorted(k for k in data if k in cls.model_fields or k == "preset")
            if stray:
                raise ValueError(f"{path}: {', '.join(stray)} sit beside 'ep:' and would be ignored; "
                                 f"move them under 'ep:'")
            data = data["ep"]
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of EPConfig fields (at the top or under 'ep:'), "
                             f"got {type(data).__name__}")
        return cls.from_dict(data, **overrides)


PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3 / R1 MoE layer: 256 routed experts, top-8, one shared expert.
    "deepseek-v3": dict(hidden_size=7168, n_experts=256, top_k=8, intermediate_size=2048,
                        n_shared_experts=1, max_tokens_per_rank=4096, gpus_per_node=4),
    # Qwen3-235B-A22B MoE layer.
    "qwen3-moe": dict(hidden_size=4096, n_experts=128, top_k=8, intermediate_size=1536,
                      max_tokens_per_rank=4096, gpus_per_node=4),
    # Mixtral 8x7B MoE layer.
    "mixtral": dict(hidden_size=4096, n_experts=8, top_k=2, intermediate_size=14336,
                    max_tokens_per_rank=4096, gpus_per_node=4),
    # Small enough for CPU workers and the Triton interpreter; E divisible by 1, 2, 4, 8.
    "tiny": dict(hidden_size=128, n_experts=16, top_k=4, intermediate_size=64,
                 max_tokens_per_rank=32, gpus_per_node=2),
}


# ---- buffer plan ---------------------------------------------------------------------------
@dataclass(frozen=True)
class BufferSpec:
    """One typed sub-buffer inside the symmetric heap block of a rank."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    """Byte offset from the start of the rank's symmetric block (ALIGN_BYTES aligned)."""

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class BufferPlan:
    """Byte layout of the symmetric buffers of one rank (the same on every rank).

    Two groups, dispatch and combine, each with send, recv and recv_count regions; every
    buffer lives in one block so that a single peer base address per rank reaches them all.
    """

    buffers: tuple[BufferSpec, ...]
    total_bytes: int

    def __getitem__(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"no buffer {name!r} in the plan; have {[b.name for b in self.buffers]}")

    def __contains__(self, name: str) -> bool:
        return any(b.name == name for b in self.buffers)

    def region_bytes(self) -> dict[str, int]:
        """Bytes per region, e.g. {'dispatch.send': ..., 'dispatch.recv': ...}."""
        out: dict[str, int] = {}
        for b in self.buffers:
            region = b.name.rsplit(".", 1)[0]
            out[region] = out.get(region, 0) + b.nbytes
        return out

    def table(self) -> str:
        """A printable table of every buffer and the total."""
        rows = [f"{'buffer':<28}{'shape':<24}{'dtype':<7}{'MiB':>10}"]
        for b in self.buffers:
            rows.append(f"{b.name:<28}{str(list(b.shape)):<24}{b.dtype:<7}{b.nbytes / 2**20:>10.2f}")
        rows.append(f"{'total per GPU':<59}{self.total_bytes / 2**20:>10.2f}")
        return "\n".join(rows)


# combine_mode "pull": rows per readiness flag (each block of partial rows a rank forms is
# announced to its source as soon as it is stored, so the source's loads start before the pass ends)
PULL_BLOCK_ROWS = 8


def plan_buffers(cfg: EPConfig) -> BufferPlan:
    """The symmetric buffers one rank needs for ``cfg``.

    Region per source rank on the receive side (R regions of N_max rows) so that no two
    writers ever touch the same bytes. ``meta`` rows hold, per token, its K global expert
    ids, K per-expert ordinals on the source and K router weights (fp32 bits): 3K int32.
    """
    R, N, H, K, L = cfg.world_size, cfg.max_tokens_per_rank, cfg.hidden_size, cfg.top_k, cfg.experts_per_rank
    fp8 = cfg.dispatch_dtype == "fp8"
    # an nvfp4 row is bytes: packed values then block scales (nvfp4_row_bytes); others a typed row
    row, x_dtype = ((nvfp4_row_bytes(H),), "u8") if cfg.dispatch_dtype == "nvfp4" else ((H,), cfg.dispatch_dtype)
    specs: list[tuple[str, tuple[int, ...], str]] = [
        # *.send: staging of the rows (and counts) put to ranks on other nodes (NVSHMEM puts)
        ("dispatch.send.x", (N, *row), x_dtype),
        ("dispatch.send.meta", (N, 3 * K), "int32"),
        ("dispatch.send.counts", (R, L + 1), "int32"),
        ("dispatch.recv.x", (R, N, *row), x_dtype),
        ("dispatch.recv.meta", (R, N, 3 * K), "int32"),
        # per round parity, per source: [rows sent, rows for each local expert]. Two sets: with
        # combine_mode "pull" a source that needs no row from this rank may publish its next
        # round's counts before this rank has read this round's (docs/design.md)
        ("dispatch.recv_count.counts", (2, R, L + 1), "int32"),
        ("dispatch.recv_count.signal", (R,), "int64"),
        ("combine.send.x", (R, N, H), cfg.combine_dtype),
        ("combine.recv.x", (R, N, H), cfg.combine_dtype),
        ("combine.recv_count.signal", (R,), "int64"),
    ]
    # per rank that holds this rank's partial rows: the epoch each block of rows is ready in
    # (pull: blocks of PULL_BLOCK_ROWS; push: of the fused combine's rows per program, 1 or more)
    specs.append(("combine.ready.signal", (R, -(-N // PULL_BLOCK_ROWS) if cfg.combine_mode == "pull" else N), "int64"))
    if fp8:
        specs.insert(1, ("dispatch.send.scales", (N, H // FP8_GROUP), "fp32"))
        specs.insert(5, ("dispatch.recv.scales", (R, N, H // FP8_GROUP), "fp32"))
    buffers, offset = [], 0
    for name, shape, dtype in specs:
        spec = BufferSpec(name, shape, dtype, offset)
        buffers.append(spec)
        offset += -(-spec.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return BufferPlan(tuple(buffers), offset)


# ---- memory plan ---------------------------------------------------------------------------
def format_bytes(nbytes: int) -> str:
    """1.25 GiB, 12.0 MiB or 512 KiB: the unit that keeps the number readable."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes / 2**10:.0f} KiB"


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one rank needs, known before anything is allocated (:func:`plan_memory`).

    On GPUs the first four live on the rank's device; on CPU workers all of them live on the
    host, and every rank of a local cluster shares that host.
    """

    symmetric: int
    """The symmetric buffers (:class:`BufferPlan`)."""
    experts_per_layer: int
    """One MoE layer's routed experts of this rank (L of them) plus the shared ones (S), bf16;
    or fp8 plus one fp32 scale per 128 x 128 block."""
    scratch: int
    """Expert intermediates for the largest receive (max_recv_rows x (2F + F + H), bf16; with
    fp8 experts the F-wide SwiGLU output is fp8 plus one fp32 scale per 128 channels)."""
    workspace: int
    """Receive description, epochs, counters, per-program tables (small)."""
    host_build: int
    """Host peak while seeded weights are built: one expert drawn in fp32 beside its bf16 copy."""
    check_reference: int
    """Host bytes of :meth:`EPCluster.check` per rank: the whole world's experts (E routed
    + S shared, bf16) that the reference needs, plus its fp32 copy of one expert."""

    def per_rank(self, layers: int = 1) -> int:
        """What a rank holds once ``layers`` expert layers are loaded."""
        return self.symmetric + self.scratch + self.workspace + layers * self.experts_per_layer

    def table(self, world_size: int, layers: int = 1) -> str:
        rows = [
            ("symmetric buffers", self.symmetric),
            (f"expert weights ({layers} layer{'s' if layers != 1 else ''})", layers * self.experts_per_layer),
            ("expert scratch", self.scratch),
            ("workspace", self.workspace),
            ("per rank (GPU memory, or host on CPU workers)", self.per_rank(layers)),
            (f"all {world_size} ranks on one host (CPU workers)", world_size * self.per_rank(layers)),
            ("host peak while building seeded weights, per rank", self.host_build),
            ("host per rank for `check` (the reference's world weights)", self.check_reference),
        ]
        return "\n".join(f"{name:<60}{format_bytes(nbytes):>12}" for name, nbytes in rows)


def micro_batch_config(cfg: EPConfig) -> EPConfig:
    """The config of each of ``cfg.micro_batches`` micro-batches: the same layer, buffers for
    ``ceil(max_tokens_per_rank / micro_batches)`` tokens."""
    return cfg.model_copy(update={"max_tokens_per_rank": -(-cfg.max_tokens_per_rank // cfg.micro_batches),
                                  "micro_batches": 1})


def plan_memory(cfg: EPConfig) -> MemoryPlan:
    """The memory of one rank of ``cfg``; see :class:`MemoryPlan` (micro-batches add their own
    symmetric buffers, workspace and expert scratch)."""
    plan = _plan_memory(cfg)
    if cfg.micro_batches > 1:
        part = _plan_memory(micro_batch_config(cfg))
        n = cfg.micro_batches
        plan = replace(plan, symmetric=plan.symmetric + n * part.symmetric, scratch=plan.scratch + n * part.scratch,
                       workspace=plan.workspace + n * part.workspace)
    return plan


def _plan_memory(cfg: EPConfig) -> MemoryPlan:
    H, Fi, L, S, E = cfg.hidden_size, cfg.intermediate_size, cfg.experts_per_rank, cfg.n_shared_experts, cfg.n_experts
    bf16 = DTYPE_BYTES["bf16"]
    expert = 3 * H * Fi * bf16  # gate_up [H, 2F] and down [F, H]
    routed, a_row = expert, Fi * bf16  # bytes of one routed expert and of one SwiGLU output row
    if cfg.expert_dtype == "fp8":
        blocks = 3 * (H // FP8_GROUP) * (Fi // FP8_GROUP)
        routed = 3 * H * Fi * DTYPE_BYTES["fp8"] + blocks * DTYPE_BYTES["fp32"]
        a_row = Fi * DTYPE_BYTES["fp8"] + Fi // FP8_GROUP * DTYPE_BYTES["fp32"]
    M, R = cfg.max_recv_rows, cfg.world_size
    # fp8 experts fed bf16 / nvfp4 rows: each receive row quantised once, fp8 with its scales
    rows_fp8 = 0
    if cfg.expert_dtype == "fp8" and cfg.dispatch_dtype != "fp8":
        rows_fp8 = R * cfg.max_tokens_per_rank * (H * DTYPE_BYTES["fp8"] + H // FP8_GROUP * DTYPE_BYTES["fp32"])
    # RecvLayout (M + L + 1 + L + R L + R int32), scratch tables (4 per SM, E int32: 132 SMs at most
    # on the GPUs we run; a bound), totals, status
    workspace = 4 * (M + 2 * L + 1 + R * L + R) + 4 * 4 * 132 * E + 4 * (E + 2 * R + 1) + 64
    return MemoryPlan(
        symmetric=plan_buffers(cfg).total_bytes,
        experts_per_layer=(L + S) * routed,
        scratch=M * ((2 * Fi + H) * bf16 + a_row) + rows_fp8,
        workspace=workspace,
        host_build=expert + 3 * H * Fi * DTYPE_BYTES["fp32"],
        check_reference=(E + S) * expert + 3 * H * Fi * DTYPE_BYTES["fp32"],
    )


def describe_config_error(e: Exception) -> str:
    """One line for a config that does not validate (a pydantic ValidationError lists each
    failed rule over several lines; the messages already say what to change)."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        parts = []
        for err in errors():
            msg = str(err.get("msg", "")).removeprefix("Value error, ")
            loc = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{loc}: {msg}" if loc else msg)
        return "; ".join(parts)
    return " ".join(str(e).split())
