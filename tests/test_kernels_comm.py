"""Dispatch and combine over a simulated world (LocalWorld: R ranks' symmetric buffers in one
process), the Triton kernels and their torch twins, against ray_ep.reference.

Every test builds all ranks' inputs from one seed, runs every rank's send, then every rank's
receive (the split form: the interpreter runs one launch at a time, so a receive may only start
once its peers have sent), and checks each rank against the plain-loop reference. The kernel
world and the twin world run in lock step on the same inputs and are compared with each other.
The fused form (send and wait in one launch) needs every rank's launch resident at once: it is
tested only on a GPU, each rank on its own CUDA stream.

Without CUDA the kernels run in Triton's CPU interpreter; with CUDA the same tests run compiled.
Legend: T tokens on a rank, K top-k, E experts, R ranks, L = E / R, H hidden, N = N_max,
M expert-major rows of a rank.
"""

import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ray_ep import reference  # noqa: E402
from ray_ep.config import FP8_GROUP, NVFP4_BLOCK, EPConfig  # noqa: E402
from ray_ep.errors import EPInputError, EPOverflowError, EPTimeoutError  # noqa: E402
from ray_ep.kernels import combine as C  # noqa: E402
from ray_ep.kernels._util import interpreted, num_sms, recorded_launches  # noqa: E402
from ray_ep.kernels import dispatch as D  # noqa: E402
from ray_ep.kernels.buffers import check_status  # noqa: E402
from ray_ep.kernels.experts import ExpertScratch, LocalExperts, run_experts_torch, shared_experts  # noqa: E402
from ray_ep.kernels.layout import compute_layout_torch  # noqa: E402
from ray_ep.kernels.pairs import join_pairs, pair_ptr, unpack_pairs  # noqa: E402
from ray_ep.transport.local import LocalWorld  # noqa: E402
from ray_ep.inputs import make_inputs  # noqa: E402
from ray_ep.weights import ExpertWeights, init_expert_weights  # noqa: E402
from ray_ep.types import RecvLayout  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
# triton 3.6's interpreter turns 1-element arrays into Python ints through a numpy path that
# numpy >= 1.25 deprecates (one warning per kernel-side index): noise, not a finding
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# Float tolerances (torch.testing.assert_close: |got - want| <= atol + rtol * |want|). Values
# are O(1): x ~ N(0, 1), experts scaled to keep activations O(1), router weights sum to 1.
TOL = {
    # combine alone (the same expert outputs y on both sides), fp32 on the wire and out: only
    # the order of the fp32 sums differs (per-rank partials, then over ranks, then + add)
    "combine-fp32": dict(atol=1e-5, rtol=1e-5),
    # bf16 on the wire and out: each rank's partial row is rounded to bf16 (truncated by the CPU
    # interpreter: up to 1 ulp = 2^-7 relative of the partial), up to min(K, R) partials per
    # token, then the bf16 output rounding (again truncation in the interpreter); partials may
    # cancel, so atol is sized on the partials (|partial| <~ 2), not the output
    "combine-bf16": dict(atol=2**-5, rtol=2**-6),
    # expert outputs of the world (run_experts_torch over the received rows) vs reference.experts:
    # the same bf16 roundings, but fp32 GEMMs of other shapes/devices can tip a bf16 rounding of
    # h, a or y by one ulp (identical on CPU)
    "experts": dict(atol=3e-2, rtol=2**-5),
    # the whole chain vs the reference MoE layer: the experts' slack plus the combine's
    "chain-fp32": dict(atol=3e-2, rtol=2**-5),
    "chain-bf16": dict(atol=5e-2, rtol=2**-5),
}
# fp8 dispatched rows, dequantised, vs the reference's dequantised rows. The kernel pre-rounds
# to the e4m3 grid exactly like the twin (bytes equal, see test_kernels_quant), so the stated
# bound is one e4m3 step: 2^-3 relative for normals, 2^-9 * scale in the subnormal range.
FP8_STEP_REL, FP8_SUBNORMAL_STEP = 2.0**-3, 2.0**-9
# and vs the original bf16 token: within half a step (round to nearest)
FP8_HALF_STEP_REL, FP8_SUBNORMAL_HALF_STEP = 2.0**-4, 2.0**-10
# nvfp4 dispatched rows equal the reference's bytes (test_kernels_nvfp4: kernel == twin ==
# oracle). Against the original token: the e2m1 grid's largest half step is 1 x the block
# scale s (between 4 and 6), and saturation at 6 costs at most 0.4 s (s is amax / 6 rounded
# to e4m3, at most 2^-4 low: 6 / (1 - 2^-4) = 6.4); the tiny preset's blocks (amax ~ 1-3)
# keep normal e4m3 scales. So |dequantised - x| <= s.
NVFP4_ERR_IN_SCALES = 1.0


def make_cfg(R: int, dispatch: str = "bf16", combine: str = "bf16", align: int = 1, nodes: int = 1,
             **overrides) -> EPConfig:
    """The tiny preset (H 128, E 16, K 4, N_max 32) on R ranks (``nodes`` nodes of R / nodes), with
    one shared expert whose output is the combine epilogue add_TH (as in a MoE layer)."""
    return EPConfig.preset("tiny", n_nodes=nodes, gpus_per_node=R // nodes, n_shared_experts=1,
                           dispatch_dtype=dispatch, combine_dtype=combine, expert_alignment=align, **overrides)


def out_dtype_of(cfg: EPConfig) -> torch.dtype:
    return torch.float32 if cfg.combine_dtype == "fp32" else torch.bfloat16


@functools.lru_cache(maxsize=None)
def expert_weights(hidden_size: int = 128) -> ExpertWeights:
    # F, E and S are the same for every world size of the tiny preset (H 128 unless a test widens it)
    return init_expert_weights(make_cfg(2, hidden_size=hidden_size), seed=0)


# ---- the two implementations --------------------------------------------------------------
@dataclass(frozen=True)
class Impl:
    name: str
    dispatch_send: Callable
    dispatch_recv: Callable
    combine_send: Callable
    combine_recv: Callable


KERNEL = Impl("kernel", D.dispatch_send, D.dispatch_recv, C.combine_send, C.combine_recv)
TWIN = Impl("twin", D.dispatch_send_torch, D.dispatch_recv_torch, C.combine_send_torch, C.combine_recv_torch)


class Sim:
    """One implementation over a LocalWorld, with each rank's experts, scratch and receive layout
    (all reused round after round, as a worker does)."""

    def __init__(self, cfg: EPConfig, impl: Impl):
        self.cfg, self.impl = cfg, impl
        self.world = LocalWorld.create(cfg, device)
        R, L = cfg.world_size, cfg.experts_per_rank
        w = expert_weights(cfg.hidden_size)
        self.experts = []
        for r in range(R):
            lw = w.local(r, L)
            self.experts.append(LocalExperts(lw.w_gate_up.to(device), lw.w_down.to(device),
                                             lw.shared_gate_up.to(device), lw.shared_down.to(device)))
        self.scratch = [ExpertScratch.allocate(cfg, device) for _ in range(R)]
        self.recv_out = [RecvLayout.allocate(cfg, device) for _ in range(R)]

    def dispatch(self, inp: "Round") -> list:
        """Split form: every rank's send, then every rank's receive. Returns the handles."""
        cfg, R = self.cfg, self.cfg.world_size
        layouts = [self.impl.dispatch_send(cfg=cfg, x_TH=inp.x_dev[r], topk_ids_TK=inp.ids_dev[r],
                                           topk_weights_TK=inp.w_dev[r], bufs=self.world.bufs[r],
                                           ws=self.world.workspaces[r])
                   for r in range(R)]
        return [self.impl.dispatch_recv(cfg=cfg, layout=layouts[r], bufs=self.world.bufs[r],
                                        ws=self.world.workspaces[r], num_tokens=inp.tokens[r], out=self.recv_out[r])
                for r in range(R)]

    def run_experts(self, handles) -> list[torch.Tensor]:
        return [run_experts_torch(handle=h, experts=e, scratch=s) for h, e, s in zip(handles, self.experts, self.scratch)]

    def combine(self, handles, ys, adds) -> list[torch.Tensor]:
        """Split form: every rank's send, then every rank's receive. Returns the outputs."""
        cfg, R = self.cfg, self.cfg.world_size
        for r in range(R):
            self.impl.combine_send(cfg=cfg, y_MH=ys[r], handle=handles[r], bufs=self.world.bufs[r],
                                   ws=self.world.workspaces[r])
        return [self.impl.combine_recv(cfg=cfg, handle=handles[r], bufs=self.world.bufs[r],
                                       ws=self.world.workspaces[r], out_dtype=out_dtype_of(cfg), add_TH=adds[r])
                for r in range(R)]

    def shared(self, inp: "Round") -> list[torch.Tensor]:
        """The combine epilogue of each rank: its shared expert over its own tokens (fp32)."""
        return [shared_experts(x, e) for x, e in zip(inp.x_dev, self.experts)]


# ---- inputs ------------------------------------------------------------------------------
@dataclass
class Round:
    """Every rank's inputs of one round, on the CPU (for the reference) and on the device; the
    reference results are computed once per round, on first use."""

    cfg: EPConfig
    xs: list[torch.Tensor]
    ids: list[torch.Tensor]
    weights: list[torch.Tensor]
    x_dev: list[torch.Tensor]
    ids_dev: list[torch.Tensor]
    w_dev: list[torch.Tensor]

    @property
    def tokens(self) -> list[int]:
        return [x.shape[0] for x in self.xs]

    @functools.cached_property
    def ref_dispatch(self) -> list[reference.RankDispatch]:
        return reference.dispatch_world(self.cfg, self.xs, self.ids)

    @functools.cached_property
    def ref_ys(self) -> list[torch.Tensor]:
        return reference.experts_world(self.cfg, self.ref_dispatch, expert_weights(self.cfg.hidden_size))

    @functools.cached_property
    def ref_layer(self) -> list[torch.Tensor]:
        """The routed part of the MoE layer in fp32: reference.combine of reference.experts."""
        return reference.combine_world(self.cfg, self.ref_ys, self.ref_dispatch, self.weights, self.tokens,
                                 out_dtype=torch.float32)

    @functools.cached_property
    def ref_moe(self) -> list[torch.Tensor]:
        return reference.moe_forward(self.cfg, self.xs, self.ids, self.weights, expert_weights(self.cfg.hidden_size))

    @functools.cached_property
    def ref_slots(self) -> list[torch.Tensor]:
        """token_slots_TR of every source rank."""
        R, L = self.cfg.world_size, self.cfg.experts_per_rank
        return [compute_layout_torch(topk_ids_TK=i, world_size=R, experts_per_rank=L).token_slots_TR for i in self.ids]


def make_round(cfg: EPConfig, tokens: list[int], seed: int, *, routing: str = "uniform", mask: float = 0.0,
               avoid_rank: int | None = None, only_expert: int | None = None, out_of_range: float = 0.0,
               strided: bool = False) -> Round:
    """Seeded inputs of every rank (one generator for the world, as every worker would build them).

    routing: as reference.make_inputs; avoid_rank: no token picks an expert of that rank (it
    receives nothing); only_expert: every token's single used slot is that expert (the other
    K - 1 slots are -1); mask / out_of_range: that fraction of slots set to -1 / to ids >= E
    (both unused); strided: x, ids and weights are column slices of wider tensors.
    """
    R, E, K, L = cfg.world_size, cfg.n_experts, cfg.top_k, cfg.experts_per_rank
    xs, ids, ws = make_inputs(cfg, tokens, seed=seed, routing=routing)
    g = torch.Generator().manual_seed(seed + 7919)
    for r in range(R):
        T = tokens[r]
        if avoid_rank is not None:
            scores = torch.rand(T, E, generator=g)
            scores[:, avoid_rank * L:(avoid_rank + 1) * L] = -1.0
            ids[r] = scores.topk(K, dim=-1).indices.to(torch.int32)
        if only_expert is not None:
            slot = torch.randint(0, K, (T,), generator=g)
            ids[r] = torch.full((T, K), -1, dtype=torch.int32)
            ids[r][torch.arange(T), slot] = only_expert
        u = torch.rand(T, K, generator=g)
        ids[r][u < mask] = -1
        ids[r][(u >= mask) & (u < mask + out_of_range)] = E + 3
    x_dev = [x.to(device) for x in xs]
    ids_dev = [i.to(device) for i in ids]
    w_dev = [w.to(device) for w in ws]
    if strided:
        x_dev = [_column_slice(x, 64) for x in x_dev]
        ids_dev = [_column_slice(i, 3) for i in ids_dev]
        w_dev = [_column_slice(w, 1) for w in w_dev]
        assert all(not t.is_contiguous() for t in x_dev + ids_dev + w_dev if t.shape[0] > 1)
    return Round(cfg, xs, ids, ws, x_dev, ids_dev, w_dev)


def _column_slice(t: torch.Tensor, start: int) -> torch.Tensor:
    """The same values as rows of a wider tensor (row stride > columns, inner dim contiguous)."""
    wide = torch.full((t.shape[0], t.shape[1] + start + 5), 99, dtype=t.dtype, device=t.device)
    wide[:, start:start + t.shape[1]] = t
    return wide[:, start:start + t.shape[1]]


def tokens_for(R: int, seed: int, most: int = 10) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, most + 1, (R,), generator=g).tolist()


# ---- checks against the reference ----------------------------------------------------------
def check_dispatch(cfg: EPConfig, handles, inp: Round) -> list[reference.RankDispatch]:
    """Each rank's receive side vs reference.dispatch; returns the reference (for combine)."""
    R, N, K, L, H = cfg.world_size, cfg.max_tokens_per_rank, cfg.top_k, cfg.experts_per_rank, cfg.hidden_size
    ref = inp.ref_dispatch
    slots = inp.ref_slots
    for r, (h, rd) in enumerate(zip(handles, ref)):
        where = f"rank {r}"
        rl = h.recv
        assert rl.row_offsets_L1.cpu().tolist() == rd.row_offsets.tolist(), where
        assert rl.num_tokens_L.cpu().tolist() == rd.num_tokens.tolist(), where
        M = int(rd.row_offsets[-1])
        assert M <= cfg.max_recv_rows
        row_ids = rl.row_ids_M[:M].cpu().long()
        real = rd.src_info[:, 0] >= 0
        assert torch.equal(row_ids >= 0, real), f"{where}: real/padding rows differ"
        assert bool((row_ids[~real] == -1).all()), f"{where}: padding rows must have row_ids -1"
        src, tok, k = (rd.src_info[real, i].long() for i in range(3))
        # rows of source s sit in region s of the receive buffer, in slot order
        assert torch.equal(row_ids[real] // N, src), where
        want_rows = torch.tensor([s * N + int(slots[s][t, r]) for s, t in zip(src.tolist(), tok.tolist())],
                                 dtype=torch.long)
        assert torch.equal(row_ids[real], want_rows), where
        # rows received from each source, and where its rows of each expert start
        assert rl.recv_counts_R.cpu().tolist() == [int((s[:, r] >= 0).sum()) for s in slots], where
        seg = torch.repeat_interleave(torch.arange(L), (rd.row_offsets[1:] - rd.row_offsets[:-1]).long())
        src_all = rd.src_info[:, 0].long()
        want_src_off = [[int(rd.row_offsets[e]) + int(((seg == e) & (src_all >= 0) & (src_all < s)).sum())
                         for e in range(L)] for s in range(R)]
        assert rl.src_offsets_RL.cpu().tolist() == want_src_off, where
        # the rows themselves: expert-major row m reads x_rows[row_ids[m]]
        gathered = h.x_rows[row_ids[real].to(h.x_rows.device)].cpu()
        x_src = torch.stack([inp.xs[s][t] for s, t in zip(src.tolist(), tok.tolist())]) if M else \
            torch.zeros(0, H, dtype=torch.bfloat16)
        if cfg.dispatch_dtype == "bf16":
            assert torch.equal(gathered, rd.x[real]), f"{where}: bf16 rows differ"
        elif cfg.dispatch_dtype == "nvfp4":
            scales = h.scales_rows[row_ids[real].to(h.x_rows.device)].cpu()
            assert torch.equal(gathered, rd.x[real]), f"{where}: nvfp4 codes differ from the oracle's"
            assert torch.equal(scales.view(torch.uint8), rd.scales[real].view(torch.uint8)), \
                f"{where}: nvfp4 block scales differ from the oracle's"
            deq = reference.dequantize_nvfp4(gathered, scales)
            scale_ch = scales.float().repeat_interleave(NVFP4_BLOCK, dim=1)
            err = (deq - x_src.float()).abs()
            assert bool((err <= NVFP4_ERR_IN_SCALES * scale_ch).all()), f"{where}: not its token"
        else:
            scales = h.scales_rows[row_ids[real].to(h.x_rows.device)].cpu()
            deq = reference.dequantize_fp8(gathered, scales)
            want = rd.dequantized()[real]
            scale_ch = rd.scales[real].repeat_interleave(FP8_GROUP, dim=1)
            step = torch.maximum(want.abs() * FP8_STEP_REL, scale_ch * FP8_SUBNORMAL_STEP)
            assert bool(((deq - want).abs() <= step).all()), f"{where}: fp8 rows beyond one e4m3 step"
            half = torch.maximum(x_src.float().abs() * FP8_HALF_STEP_REL, scale_ch * FP8_SUBNORMAL_HALF_STEP)
            assert bool(((deq - x_src.float()).abs() <= half * (1 + 2**-20)).all()), f"{where}: not its token"
            torch.testing.assert_close(scales, rd.scales[real], atol=0.0, rtol=0.0)
        # the meta row travels with it: the token's K ids and router weights
        meta = h.meta_rows[row_ids[real].to(h.meta_rows.device)].cpu()
        want_ids = torch.stack([inp.ids[s][t] for s, t in zip(src.tolist(), tok.tolist())]) if M else meta[:, :K]
        want_w = torch.stack([inp.weights[s][t] for s, t in zip(src.tolist(), tok.tolist())]) if M else \
            meta[:, 2 * K:].contiguous().view(torch.float32)
        assert torch.equal(meta[:, :K], want_ids), where
        assert torch.equal(meta[:, 2 * K:].contiguous().view(torch.float32), want_w), where
    return ref


def check_chain(cfg: EPConfig, inp: Round, ref: list, ys, outs, adds) -> None:
    """Expert outputs vs reference.experts; combine vs reference.combine of the same expert
    outputs (tight); the whole chain vs the reference MoE layer (moe_forward's formula)."""
    R = cfg.world_size
    ref_ys = inp.ref_ys
    ys_cpu = []
    for r in range(R):
        M = int(ref[r].row_offsets[-1])
        real = ref[r].src_info[:, 0] >= 0
        y = ys[r][:M].cpu()
        torch.testing.assert_close(y[real].float(), ref_ys[r][real].float(), **TOL["experts"])
        ys_cpu.append(y)
    kind = cfg.combine_dtype
    od = out_dtype_of(cfg)
    alone = reference.combine_world(cfg, ys_cpu, ref, inp.weights, inp.tokens, out_dtype=torch.float32)
    layer = inp.ref_layer
    for r in range(R):
        out = outs[r]
        assert out.dtype == od and tuple(out.shape) == (inp.tokens[r], cfg.hidden_size) and out.device.type == device
        add = adds[r].float().cpu() if adds[r] is not None else 0.0
        torch.testing.assert_close(out.float().cpu(), alone[r] + add, **TOL[f"combine-{kind}"],
                                   msg=lambda m, r=r: f"rank {r} combine: {m}")
        torch.testing.assert_close(out.float().cpu(), layer[r] + add, **TOL[f"chain-{kind}"],
                                   msg=lambda m, r=r: f"rank {r} chain: {m}")
    if od == torch.bfloat16 and all(a is not None for a in adds):
        # the epilogue is the shared expert: the kernel chain is a whole MoE layer
        want = inp.ref_moe
        for r in range(R):
            torch.testing.assert_close(outs[r].float().cpu(), want[r].float(), **TOL["chain-bf16"])


def check_twins_agree(cfg: EPConfig, kh, th, k_outs, t_outs, k_sim: Sim, t_sim: Sim) -> None:
    """Kernel world vs twin world on the same inputs: layouts and bytes exact, outputs close."""
    R, N = cfg.world_size, cfg.max_tokens_per_rank
    for r in range(R):
        for name in ("token_slots_TR", "ordinals_TK", "expert_counts_E", "rank_counts_R"):
            assert torch.equal(getattr(kh[r].layout, name), getattr(th[r].layout, name)), f"rank {r} {name}"
        M = int(th[r].recv.row_offsets_L1[-1])
        assert torch.equal(kh[r].recv.row_ids_M[:M], th[r].recv.row_ids_M[:M]), f"rank {r} row_ids"
        for name in ("row_offsets_L1", "num_tokens_L", "src_offsets_RL", "recv_counts_R"):
            assert torch.equal(getattr(kh[r].recv, name), getattr(th[r].recv, name)), f"rank {r} {name}"
        # received bytes of every live row (the rest of a region is stale by design)
        kv, tv = k_sim.world.bufs[r].local, t_sim.world.bufs[r].local
        live = torch.cat([s * N + torch.arange(int(n)) for s, n in enumerate(th[r].recv.recv_counts_R.tolist())])
        live = live.to(device)
        for name in [n for n in kv if n.startswith("dispatch.recv.")]:
            a, b = kv[name].flatten(0, 1)[live], tv[name].flatten(0, 1)[live]
            if a.dtype == torch.float8_e4m3fn:
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert torch.equal(a, b), f"rank {r} {name}"
        assert torch.equal(kv["dispatch.recv_count.counts"], tv["dispatch.recv_count.counts"]), f"rank {r} counts"
        torch.testing.assert_close(k_outs[r].float(), t_outs[r].float(), **TOL[f"combine-{cfg.combine_dtype}"])
    for a, b in zip(k_sim.world.workspaces, t_sim.world.workspaces):
        assert torch.equal(a.epochs, b.epochs)


def run_round(cfg: EPConfig, sims: tuple[Sim, Sim], inp: Round, with_add: bool = True):
    """One round on the kernel world and the twin world; every check. Returns the kernel outputs."""
    k_sim, t_sim = sims
    results = []
    for sim in sims:
        handles = sim.dispatch(inp)
        ref = check_dispatch(cfg, handles, inp)
        ys = sim.run_experts(handles)
        adds = sim.shared(inp) if with_add else [None] * cfg.world_size
        outs = sim.combine(handles, ys, adds)
        check_chain(cfg, inp, ref, ys, outs, adds)
        results.append((handles, outs))
    (kh, k_outs), (th, t_outs) = results
    check_twins_agree(cfg, kh, th, k_outs, t_outs, k_sim, t_sim)
    return k_outs


def sims_for(cfg: EPConfig) -> tuple[Sim, Sim]:
    return Sim(cfg, KERNEL), Sim(cfg, TWIN)


@pytest.fixture(params=[2, 4, 8], ids=lambda r: f"R{r}")
def world_size(request) -> int:
    return request.param


# ---- rounds: every world size, both dtypes each way, alignment 1 and 4 -----------------------
# (R, dispatch dtype, combine dtype, expert_alignment): every dtype pair and alignment at R = 2,
# mixed at R = 4 and 8 (the interpreter is slow: R = 8 costs ~4x R = 2 per round); three
# rounds each on the same buffers (epochs)
ROUND_CASES = [
    (2, "bf16", "bf16", 1), (2, "bf16", "fp32", 4), (2, "fp8", "bf16", 1), (2, "fp8", "fp32", 4),
    (4, "bf16", "fp32", 1), (4, "fp8", "bf16", 4),
    (8, "fp8", "fp32", 1),  # R = 8 with bf16 dispatch and alignment 4: test_largest_batch
    # nvfp4 wire rows (packed codes + block scales in one row of bytes) on every world size
    (2, "nvfp4", "bf16", 1), (4, "nvfp4", "fp32", 4), (8, "nvfp4", "bf16", 1),
]


@pytest.mark.parametrize("R,dispatch,combine,align", ROUND_CASES,
                         ids=[f"R{r}-{d}-{c}-A{a}" for r, d, c, a in ROUND_CASES])
def test_three_rounds(R, dispatch, combine, align):
    three_rounds(make_cfg(R, dispatch, combine, align), ["uniform", "skewed", "uniform"], 100 * R, 1000 * R)


def three_rounds(cfg: EPConfig, routings: list[str], token_seed: int, seed: int) -> None:
    """Three rounds on the same buffers (epochs), kernel and twin against the reference: fresh
    inputs and token counts each round, the last round masking some slots."""
    sims = sims_for(cfg)
    for rnd, routing in enumerate(routings):
        inp = make_round(cfg, tokens_for(cfg.world_size, token_seed + rnd), seed=seed + rnd, routing=routing,
                         mask=0.25 if rnd == 2 else 0.0)
        run_round(cfg, sims, inp)
        for sim in sims:
            for ws in sim.world.workspaces:
                assert ws.epochs.tolist() == [rnd + 1, rnd + 1]
                assert ws.counters.tolist() == [0, 0, 0, 0] and int(ws.status.abs().sum()) == 0


# combine_mode "pull": each rank keeps its partial rows, the sources load them (kernel and twin)
PULL_CASES = [(2, "bf16", "bf16", 1), (4, "fp8", "fp32", 4), (8, "bf16", "bf16", 1)]


@pytest.mark.parametrize("R,dispatch,combine,align", PULL_CASES,
                         ids=[f"R{r}-{d}-{c}-A{a}" for r, d, c, a in PULL_CASES])
def test_three_rounds_pulling_the_combine(R, dispatch, combine, align):
    three_rounds(make_cfg(R, dispatch, combine, align, combine_mode="pull"), ["skewed", "uniform", "skewed"], 500,
                 5000 * R)


def test_pulled_partial_rows_stay_on_their_rank():
    """Pull: a rank's send writes only its own buffer (every source's rows there), never a peer's."""
    R = 4
    cfg = make_cfg(R, "bf16", "fp32", combine_mode="pull")
    sim = Sim(cfg, KERNEL)
    inp = make_round(cfg, [5, 3, 6, 2], seed=41, routing="skewed")
    handles = sim.dispatch(inp)
    ys = sim.run_experts(handles)
    for b in sim.world.bufs:
        b.local["combine.recv.x"].fill_(7.0)
    writer = 2
    C.combine_send(cfg=cfg, y_MH=ys[writer], handle=handles[writer], bufs=sim.world.bufs[writer],
                   ws=sim.world.workspaces[writer])
    for r, b in enumerate(sim.world.bufs):
        rows = b.local["combine.recv.x"]
        if r != writer:
            assert bool((rows == 7.0).all()), f"rank {r}'s partial rows were written by rank {writer}"
    want = C.combine_partials_torch(cfg=cfg, rank=writer, y_MH=ys[writer],
                                    src_offsets_RL=handles[writer].recv.src_offsets_RL,
                                    counts_R=handles[writer].recv.recv_counts_R, meta_rows=handles[writer].meta_rows,
                                    row_base_R=torch.arange(R, device=device) * cfg.max_tokens_per_rank)
    own = sim.world.bufs[writer].local["combine.recv.x"]
    for s in range(R):
        n = want[s].shape[0]
        torch.testing.assert_close(own[s, :n].float().cpu(), want[s].float().cpu(), atol=1e-5, rtol=1e-5)
        assert bool((own[s, n:] == 7.0).all()), f"rows past source {s}'s {n} were written"


@pytest.mark.parametrize("impl", [KERNEL, TWIN], ids=lambda i: i.name)
def test_pull_source_a_round_ahead_of_a_rank_it_needs_nothing_from(impl):
    """Pull: a source whose tokens go to no expert of rank d never waits for d in its combine,
    so it may send its next dispatch (counts included) before d has even received this round's.
    d must still lay out this round from this round's counts (two sets, by round parity)."""
    cfg = make_cfg(2, "bf16", "fp32", combine_mode="pull")
    sim = Sim(cfg, impl)
    first = make_round(cfg, [6, 5], seed=61, avoid_rank=1)  # nobody routes to rank 1's experts
    second = make_round(cfg, [7, 4], seed=62)  # rank 0 sends rank 1 rows again
    assert not any((i // cfg.experts_per_rank == 1).any() for i in first.ids)
    assert bool((second.ids[0] // cfg.experts_per_rank == 1).any())
    b, w = sim.world.bufs, sim.world.workspaces

    def send(r, inp):
        return impl.dispatch_send(cfg=cfg, x_TH=inp.x_dev[r], topk_ids_TK=inp.ids_dev[r], topk_weights_TK=inp.w_dev[r],
                                  bufs=b[r], ws=w[r])

    def recv(r, inp, layout):
        return impl.dispatch_recv(cfg=cfg, layout=layout, bufs=b[r], ws=w[r], num_tokens=inp.tokens[r],
                                  out=sim.recv_out[r])

    def experts(r, handle):  # rank r's own experts and scratch (Sim.run_experts takes every rank's)
        return run_experts_torch(handle=handle, experts=sim.experts[r], scratch=sim.scratch[r])

    def combine(r, handle, y):
        impl.combine_send(cfg=cfg, y_MH=y, handle=handle, bufs=b[r], ws=w[r])
        return impl.combine_recv(cfg=cfg, handle=handle, bufs=b[r], ws=w[r], out_dtype=torch.float32)

    layouts = [send(r, first) for r in range(2)]
    h0 = recv(0, first, layouts[0])
    y0 = experts(0, h0)
    out0 = combine(0, h0, y0)  # needs only its own rows: done without rank 1
    ahead = send(0, second)  # rank 0's next dispatch reaches rank 1 first
    h1 = recv(1, first, layouts[1])  # rank 1's receive of the first round, after it
    assert h1.recv.recv_counts_R.cpu().tolist() == [0, 0], "rank 1 read the next round's counts"
    y1 = experts(1, h1)
    # rank 1's rows were formed in rank 0's pass above: rank 1 takes no part in rank 0's rows
    out1 = combine(1, h1, y1)
    check_chain(cfg, first, first.ref_dispatch, [y0, y1], [out0, out1], [None, None])
    # the second round goes on from there and is whole too
    behind = send(1, second)
    handles = [recv(0, second, ahead), recv(1, second, behind)]
    ref = check_dispatch(cfg, handles, second)
    ys = sim.run_experts(handles)
    outs = sim.combine(handles, ys, [None, None])
    check_chain(cfg, second, ref, ys, outs, [None, None])


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_launches_report_programs_and_sms(mode):
    # a budget of 1 SM: push sends on the budget, pull forms its partial rows on the SMs the
    # budget leaves (the interpreter's 4 stand-ins leave 3; a GPU's, as many as its rows fill);
    # both receive on the budget
    cfg = make_cfg(4, "bf16", "bf16", num_sms=1, combine_mode=mode)
    sim = Sim(cfg, KERNEL)
    inp = make_round(cfg, [9, 7, 8, 6], seed=61)
    handles = sim.dispatch(inp)
    ys = sim.run_experts(handles)
    with recorded_launches() as launches, recorded_launches(timed=True) as timed:
        sim.combine(handles, ys, [None] * 4)
    got = [(r.kernel, r.programs, r.sms) for r in launches]
    assert got == [(r.kernel, r.programs, r.sms) for r in timed]
    # a timed block marks each launch (the interpreter runs it before the launch returns)
    assert all(r.elapsed_us() is None for r in launches) and all(r.elapsed_us() > 0 for r in timed)
    assert got[4:] == [("_combine_recv_kernel", 1, 1)] * 4
    left = num_sms(device) - 1
    # on Hopper the push send under a budget is the Gluon one (kernels/combine_sm90.py)
    sends = ["_combine_send_sm90_kernel" if C.sm90.usable(cfg, y, 1) else "_combine_send_kernel" for y in ys]
    assert [k for k, _, _ in got[:4]] == sends, got
    for kernel, programs, sms in got[:4]:
        assert sms == programs, got
        if mode == "push":
            assert programs == 1, got
        else:
            assert (programs == left) if device == "cpu" else (1 < programs <= left), got


def test_launch_times_are_per_launch_medians_of_calls_after_the_timed_ones(monkeypatch):
    # a transport whose dispatch launches two kernels and whose combine launches one: each
    # gets its median over the extra calls, in launch order; every call starts after a barrier
    from ray_ep.bench import loops
    from ray_ep.kernels._util import launch

    @triton.jit
    def _add_one(x_ptr, n, B: tl.constexpr):
        i = tl.arange(0, B)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    x = torch.zeros(64, device=device)

    def run(kernels: int):
        for _ in range(kernels):
            launch(_add_one, work=1, device=torch.device(device), budget=None, resident=False,
                   args=dict(x_ptr=x, n=64), meta=dict(B=64))

    class Fake:
        barriers = 0

        def barrier(self):
            Fake.barriers += 1

        def device_barrier(self):  # a GPU's clock also lines the ranks up on the stream
            pass

        def dispatch(self, x, ids, w, fused):
            run(2)
            return None

        def combine(self, y, h, dtype, fused):
            run(1)

    monkeypatch.setattr(loops, "identity_outputs", lambda h: None)
    t = Fake()
    got = loops.launch_times(t, [(None, None, None)], loops.Clock(torch.device(device), t), fused=True, iters=3)
    assert [len(got["dispatch"]), len(got["combine"])] == [2, 1]
    assert all(us > 0 for us in got["dispatch"] + got["combine"])
    assert Fake.barriers == 6 and x[0] == 9


@pytest.mark.parametrize("dispatch", ["bf16", "fp8", "nvfp4"])
def test_fused_calls_under_a_budget_launch_their_two_halves(monkeypatch, dispatch):
    # under an SM budget a batch of more tokens than SMs runs as the split form's send and
    # receive launches (faster there on GPUs); a batch of at most a token per SM, or any batch
    # without a budget, keeps the one fused launch. Launches are recorded, not run.
    seen = []
    for mod in (D, C):
        monkeypatch.setattr(mod, "launch", lambda kernel, **kw: seen.append(kernel.fn.__name__))
    sms = num_sms("cpu")
    for budget, T, kernels in [(2, sms, ["fused"]), (2, sms + 1, ["send", "recv"]), (None, sms + 1, ["fused"])]:
        cfg = make_cfg(2, dispatch, max_tokens_per_rank=32, num_sms=budget)
        world = LocalWorld.create(cfg, device="cpu")
        bufs, ws = world.bufs[0], world.workspaces[0]
        x = torch.zeros(T, cfg.hidden_size, dtype=torch.bfloat16)
        ids = torch.zeros(T, cfg.top_k, dtype=torch.int32)
        seen.clear()
        handle = D.dispatch_fused(cfg=cfg, x_TH=x, topk_ids_TK=ids, topk_weights_TK=torch.zeros(T, cfg.top_k),
                                  bufs=bufs, ws=ws, check=False)
        y = torch.zeros(cfg.max_recv_rows, cfg.hidden_size, dtype=torch.bfloat16)
        out = C.combine_fused(cfg=cfg, y_MH=y, handle=handle, bufs=bufs, ws=ws, check=False)
        assert out.shape == (T, cfg.hidden_size)
        assert seen == [f"_{op}_{k}_kernel" for op in ("dispatch", "combine") for k in kernels], (budget, T)


def test_pull_combine_needs_one_node():
    with pytest.raises(ValueError, match="combine_mode 'pull'.*one node.*n_nodes = 2"):
        make_cfg(4, nodes=2, combine_mode="pull")


@pytest.mark.parametrize("dispatch,expert", [("fp8", "bf16"), ("nvfp4", "bf16"), ("bf16", "fp8")])
def test_expert_kernels_convert_the_receive_regions(dispatch, expert):
    # rows that reach the GEMMs in the other tensor-core dtype are converted once per receive
    # row (the receive regions and their counts) rather than once per expert row reading it:
    # the expert kernels (as a GPU runs them) give bit for bit what the per-row pass gives, and
    # stay within the chain tolerance of the twin
    from ray_ep.kernels.activation import swiglu
    from ray_ep.kernels.experts import _run
    from ray_ep.kernels.grouped_gemm import grouped_gemm
    cfg = make_cfg(2, dispatch, intermediate_size=128, expert_dtype=expert)
    sim = Sim(cfg, KERNEL)
    inp = make_round(cfg, [9, 6], seed=31, routing="skewed")
    handles = sim.dispatch(inp)
    weights = init_expert_weights(cfg, seed=31)
    for r, h in enumerate(handles):
        experts = LocalExperts.build(cfg, weights.local(r, cfg.experts_per_rank), device)
        scratch = ExpertScratch.allocate(cfg, device)
        assert scratch.region_rows == cfg.max_tokens_per_rank
        by_region = _run(grouped_gemm, swiglu, h, experts, scratch, None, None, fuse=True).clone()
        scratch = dataclasses.replace(ExpertScratch.allocate(cfg, device), region_rows=0)
        by_row = _run(grouped_gemm, swiglu, h, experts, scratch, None, None, fuse=True)
        real = (h.recv.row_ids_M >= 0).cpu()
        assert int(real.sum()) > 0
        assert torch.equal(by_region.cpu()[real], by_row.cpu()[real])
        twin = run_experts_torch(handle=h, experts=experts, scratch=ExpertScratch.allocate(cfg, device, rows=0))
        n = int(h.recv.row_offsets_L1[-1])
        got, want = by_region.cpu()[:n][real[:n]].float(), twin.cpu()[:n][real[:n]].float()
        assert (got - want).abs().max() <= 0.05 * want.abs().max()


def _step_rows() -> int:
    """Rows of a program's tile in the tests that shrink its channel step: 16 in the
    interpreter (whole blocks of rows), 1 on a GPU (as tile_shape: a program of 16 rows at
    4 warps each would need 2048 threads, above the 1024 a block may have)."""
    return 16 if interpreted() else 1


@pytest.mark.parametrize("dispatch", ["bf16", "fp8", "nvfp4"])
def test_rows_in_several_channel_steps(monkeypatch, dispatch):
    # a GPU program walks its rows a step of channels at a time (fp8 and nvfp4 rows load the
    # next step while this one quantises); the interpreter takes whole rows in one step, which
    # would hide a step mixed up: here 128 channels per step (fp8's scale group), 4 per row
    from ray_ep.kernels import _util

    monkeypatch.setattr(_util, "tile_shape", lambda H, device, multiple=8: (_step_rows(), max(multiple, 128)))
    cfg = make_cfg(2, dispatch, "bf16", 1, hidden_size=512)
    run_round(cfg, sims_for(cfg), make_round(cfg, tokens_for(2, 7), seed=77, routing="skewed", mask=0.1))


@pytest.mark.parametrize("step,hidden", [(32, 224), (128, 160)], ids=["32-of-224", "128-of-160"])
def test_nvfp4_rows_in_small_and_partial_steps(monkeypatch, step, hidden):
    # nvfp4 wire rows sent a step of channels at a time: steps of 2 scale blocks (32 channels),
    # and a last step that ends inside a 4-block group (160 channels: 10 block scales)
    from ray_ep.kernels import _util

    monkeypatch.setattr(_util, "tile_shape", lambda H, device, multiple=8: (_step_rows(), max(multiple, step)))
    cfg = make_cfg(2, "nvfp4", "bf16", 1, hidden_size=hidden)
    run_round(cfg, sims_for(cfg), make_round(cfg, tokens_for(2, 5), seed=55, routing="skewed", mask=0.1))


@pytest.mark.parametrize("R", [2, 4])
def test_rows_with_many_local_experts(R):
    """Top-8 over 8 experts per rank: many received rows carry more than 4 local experts, and the
    combine must sum all of them (the other cases have at most top-4)."""
    cfg = make_cfg(R, "bf16", "fp32", top_k=8)
    inp = make_round(cfg, tokens_for(R, 7), seed=77, routing="skewed")
    run_round(cfg, sims_for(cfg), inp)


# ---- several nodes: ranks on other nodes get puts of staged rows ------------------------------
# In the interpreter a put is a byte copy through the peer table (kernels/_shmem.py); compiled,
# it is NVSHMEM's device library, which needs an NVSHMEM job: tests/test_gpu.py runs it on GPUs.
on_cpu_only = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="compiled multi-node kernels call NVSHMEM (tests/test_gpu.py, 2x2)")
NODE_CASES = [(2, 1, "bf16", "bf16", 1), (2, 2, "fp8", "bf16", 4), (2, 2, "bf16", "fp32", 1),
              (4, 1, "fp8", "fp32", 1), (2, 2, "nvfp4", "bf16", 1)]


@on_cpu_only
@pytest.mark.parametrize("nodes,per_node,dispatch,combine,align", NODE_CASES,
                         ids=[f"{n}x{g}-{d}-{c}-A{a}" for n, g, d, c, a in NODE_CASES])
def test_three_rounds_across_nodes(nodes, per_node, dispatch, combine, align):
    R = nodes * per_node
    cfg = make_cfg(R, dispatch, combine, align, nodes=nodes)
    sims = sims_for(cfg)
    for rnd, routing in enumerate(["skewed", "uniform", "one-expert"]):
        inp = make_round(cfg, tokens_for(R, 700 + rnd), seed=700 + rnd, routing=routing,
                         mask=0.25 if rnd == 1 else 0.0)
        run_round(cfg, sims, inp)
        for ws in sims[0].world.workspaces:
            assert ws.epochs.tolist() == [rnd + 1, rnd + 1] and int(ws.status.abs().sum()) == 0


LARGE_BUDGET_CASES = [(1, "bf16", "bf16", 3), (1, "fp8", "fp32", 2), (1, "nvfp4", "bf16", 3), (2, "fp8", "bf16", 3),
                      (2, "bf16", "fp32", 5)]


@pytest.mark.parametrize("nodes,dispatch,combine,budget", LARGE_BUDGET_CASES,
                         ids=[f"{n}node-{d}-{c}-{b}sms" for n, d, c, b in LARGE_BUDGET_CASES])
def test_large_batches_under_an_sm_budget(nodes, dispatch, combine, budget):
    """Above SELF_LAYOUT_MAX_T tokens under an SM budget a bf16 or fp8 send assigns its own
    chunks (LAYOUT_CHUNKED; across nodes it also stages and puts), nvfp4 takes
    compute_layout first: whole rounds against the reference, skewed and masked routing, a
    rank with no tokens and one with fewer than a chunk."""
    if nodes > 1 and torch.cuda.is_available():
        pytest.skip("compiled multi-node kernels call NVSHMEM (tests/test_gpu.py, 2x2)")
    cfg = make_cfg(4, dispatch, combine, nodes=nodes, max_tokens_per_rank=320, num_sms=budget)
    sims = sims_for(cfg)
    for rnd, (routing, mask) in enumerate([("skewed", 0.0), ("uniform", 0.2)]):
        with recorded_launches() as launches:
            run_round(cfg, sims, make_round(cfg, [300, 0, 257, 40], seed=820 + rnd, routing=routing, mask=mask))
        kernels = {r.kernel for r in launches}
        assert "_chunk_count_kernel" in kernels and ("_chunk_assign_kernel" in kernels) == (dispatch == "nvfp4")
        assert all(r.programs <= budget for r in launches if "dispatch" in r.kernel or "chunk" in r.kernel)


def test_budgeted_fp8_send_in_the_gpus_whole_steps(monkeypatch):
    """The fp8 send in the whole-step form it took from v27 to v41 under a budget that binds
    it by its SMs (on 4x H200 at 16 SMs: 16 rows x 1024 of deepseek-v3's 7168 channels, rows
    read as words), whose checks failed now and then on 4x H200 (docs/perf.md v42; the send no
    longer picks it for fp8): its logic is right. The interpreter's own tile is whole rows;
    forced here: 16 rows, steps of 256 over H 1792 (7 steps a row), chunked layout on 4 ranks,
    against the reference."""
    real = D._send_tile

    def gpu_tile(cfg, device, budget, tokens=None):
        return (16, 256, 32) if budget else real(cfg, device, budget, tokens)

    monkeypatch.setattr(D, "_send_tile", gpu_tile)
    cfg = make_cfg(4, "fp8", "bf16", max_tokens_per_rank=320, num_sms=2, hidden_size=1792)
    assert D._read_mode(cfg, torch.zeros(1, 1792, dtype=torch.bfloat16), "fp8", 2) == D.READ_WORDS.value
    sims = sims_for(cfg)
    for rnd, (routing, mask) in enumerate([("skewed", 0.0), ("uniform", 0.2)]):
        run_round(cfg, sims, make_round(cfg, [300, 0, 257, 40], seed=830 + rnd, routing=routing, mask=mask))


@on_cpu_only
def test_puts_touch_only_other_nodes():
    """Ranks on this node get stores, never staging: the send rows of a rank whose peers all
    share its node stay untouched (zero), while a 2x1 world stages every sent row."""
    for nodes, staged in [(1, False), (2, True)]:
        cfg = make_cfg(2, "bf16", "bf16", nodes=nodes)
        sim = Sim(cfg, KERNEL)
        inp = make_round(cfg, [5, 3], seed=71)
        handles = sim.dispatch(inp)
        sim.combine(handles, sim.run_experts(handles), sim.shared(inp))
        sent = sim.world.bufs[0].local["dispatch.send.x"].view(torch.int16)
        assert bool(sent[:5].any()) is staged
        assert not bool(sent[5:].any())


@on_cpu_only
def test_missing_sender_on_other_node_times_out():
    cfg = make_cfg(4, "bf16", "bf16", nodes=2, recv_timeout_s=TIMEOUT_S)
    sim = Sim(cfg, KERNEL)
    silent = 3  # node 1
    inp = make_round(cfg, tokens_for(4, 24, most=4), seed=72)
    layouts = [None] * 4
    for r in range(4):
        if r != silent:
            layouts[r] = KERNEL.dispatch_send(cfg=cfg, x_TH=inp.x_dev[r], topk_ids_TK=inp.ids_dev[r],
                                              topk_weights_TK=inp.w_dev[r], bufs=sim.world.bufs[r],
                                              ws=sim.world.workspaces[r])
    for r in range(4):
        with pytest.raises(EPTimeoutError, match=rf"dispatch: rank\(s\) \[{silent}\] stayed silent: rank {r} timed out"):
            KERNEL.dispatch_recv(cfg=cfg, layout=layouts[r], bufs=sim.world.bufs[r], ws=sim.world.workspaces[r],
                                 num_tokens=inp.tokens[r])


# ---- edge cases (one round; kernel and twin) ---------------------------------------------------
@pytest.mark.parametrize("dispatch", ["fp8", "nvfp4"])
def test_rank_with_zero_tokens(dispatch):
    cfg = make_cfg(4, dispatch, "bf16", 4)
    run_round(cfg, sims_for(cfg), make_round(cfg, [0, 6, 3, 0], seed=11))


def test_every_rank_with_zero_tokens():
    cfg = make_cfg(2, "bf16", "fp32")
    outs = run_round(cfg, sims_for(cfg), make_round(cfg, [0, 0], seed=12))
    assert all(o.shape == (0, cfg.hidden_size) for o in outs)


@pytest.mark.parametrize("dispatch", ["bf16", "fp8", "nvfp4"])
def test_rank_that_receives_nothing(dispatch):
    # every token of every rank (rank 2 included) goes to experts of the other ranks
    cfg = make_cfg(4, dispatch, "fp32", 4)
    sims = sims_for(cfg)
    inp = make_round(cfg, [5, 4, 6, 3], seed=13, avoid_rank=2)
    run_round(cfg, sims, inp)
    for sim in sims:
        assert sim.recv_out[2].recv_counts_R.tolist() == [0, 0, 0, 0]
        assert sim.recv_out[2].row_offsets_L1.tolist() == [0] * (cfg.experts_per_rank + 1)


@pytest.mark.parametrize("variant", ["only-that-expert", "first-choice"])
def test_all_tokens_to_one_expert(variant):
    if variant == "only-that-expert":  # one used slot per token, the other K - 1 masked
        cfg = make_cfg(4, "bf16", "bf16", 4)
        inp = make_round(cfg, [7, 5, 9, 2], seed=14, only_expert=6)
    else:  # expert 0 in every token's top-k, the rest uniform
        cfg = make_cfg(2, "fp8", "bf16", 4)
        inp = make_round(cfg, [7, 9], seed=14, routing="one-expert")
    sims = sims_for(cfg)
    run_round(cfg, sims, inp)
    if variant == "only-that-expert":  # expert 6 = rank 1, local expert 2
        for sim in sims:
            assert sim.recv_out[1].num_tokens_L.tolist() == [0, 0, 23, 0]
            assert sim.recv_out[1].row_offsets_L1.tolist() == [0, 0, 0, 24, 24]


def test_masked_and_out_of_range_ids():
    cfg = make_cfg(2, "fp8", "fp32", 4)
    run_round(cfg, sims_for(cfg), make_round(cfg, [9, 8], seed=15, mask=0.3, out_of_range=0.2))


@pytest.mark.parametrize("dispatch", ["bf16", "fp8", "nvfp4"])
def test_non_contiguous_inputs(dispatch):
    # x, topk_ids and topk_weights are rows of wider tensors; add_TH too (x's rows start at odd
    # channels, so a quantising send reads them as elements, not words: READ_ELEMENTS)
    cfg = make_cfg(2, dispatch, "bf16")
    sims = sims_for(cfg)
    inp = make_round(cfg, [6, 9], seed=16, strided=True)
    results = []
    for sim in sims:
        handles = sim.dispatch(inp)
        ref = check_dispatch(cfg, handles, inp)
        ys = sim.run_experts(handles)
        adds = [_column_slice(a.to(torch.bfloat16), 32) for a in sim.shared(inp)]
        assert not adds[1].is_contiguous()
        outs = sim.combine(handles, ys, adds)
        check_chain(cfg, inp, ref, ys, outs, adds)
        results.append((handles, outs))
    check_twins_agree(cfg, results[0][0], results[1][0], results[0][1], results[1][1], *sims)


@pytest.mark.parametrize("dispatch", ["bf16", "fp8"])
def test_no_epilogue(dispatch):
    cfg = make_cfg(2, dispatch, "bf16")
    run_round(cfg, sims_for(cfg), make_round(cfg, [4, 7], seed=17), with_add=False)


def test_largest_batch():
    # T = N_max on every rank of the largest world
    cfg = make_cfg(8, "bf16", "bf16", 4)
    N = cfg.max_tokens_per_rank
    run_round(cfg, sims_for(cfg), make_round(cfg, [N] * 8, seed=18))


def test_largest_batch_fills_one_rank():
    # T = N_max on every rank and every token picks the K = 4 experts of rank 0: rank 0
    # receives R * N_max * min(K, L) rows: its whole receive capacity but the padding allowance
    cfg = make_cfg(2, "bf16", "fp32", 4)
    R, N, K = cfg.world_size, cfg.max_tokens_per_rank, cfg.top_k
    inp = make_round(cfg, [N] * R, seed=19)
    for r in range(R):
        perm = torch.stack([torch.randperm(K, generator=torch.Generator().manual_seed(t)) for t in range(N)])
        inp.ids[r] = perm.to(torch.int32)  # experts 0..3, in varying slot order
        inp.ids_dev[r] = inp.ids[r].to(device)
    sims = sims_for(cfg)
    run_round(cfg, sims, inp)
    for sim in sims:
        assert int(sim.recv_out[0].row_offsets_L1[-1]) == R * N * K <= cfg.max_recv_rows
        assert sim.recv_out[1].recv_counts_R.tolist() == [0, 0]


# ---- errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", [KERNEL, TWIN], ids=lambda i: i.name)
def test_too_many_tokens_raises_before_sending(impl):
    cfg = make_cfg(2, "fp8", "bf16")
    sim = Sim(cfg, impl)
    N = cfg.max_tokens_per_rank
    inp = make_round(cfg, [N + 1, 3], seed=20)
    before = [b.clone() for b in sim.world.blocks]
    with pytest.raises(EPInputError, match=f"{N + 1} tokens exceed max_tokens_per_rank = {N}"):
        impl.dispatch_send(cfg=cfg, x_TH=inp.x_dev[0], topk_ids_TK=inp.ids_dev[0], topk_weights_TK=inp.w_dev[0],
                           bufs=sim.world.bufs[0], ws=sim.world.workspaces[0])
    for b0, b1 in zip(before, sim.world.blocks):
        assert torch.equal(b0, b1), "a symmetric buffer changed"
    for ws in sim.world.workspaces:
        assert ws.epochs.tolist() == [0, 0] and ws.counters.tolist() == [0, 0, 0, 0]
    # the world is still usable: a valid round right after
    ok = make_round(cfg, [N, 3], seed=21)
    handles = sim.dispatch(ok)
    check_dispatch(cfg, handles, ok)


@pytest.mark.parametrize("impl", [KERNEL, TWIN], ids=lambda i: i.name)
def test_overflowing_source_raises(impl):
    # rank 0's counts in rank 1's buffer claim N_max + 1 rows: more than its region holds (in
    # the set of the first round's parity, epoch 0 + 1)
    cfg = make_cfg(2, "bf16", "bf16")
    sim = Sim(cfg, impl)
    inp = make_round(cfg, [5, 6], seed=22)
    layouts = [impl.dispatch_send(cfg=cfg, x_TH=inp.x_dev[r], topk_ids_TK=inp.ids_dev[r],
                                  topk_weights_TK=inp.w_dev[r], bufs=sim.world.bufs[r], ws=sim.world.workspaces[r])
               for r in range(2)]
    sim.world.bufs[1].local["dispatch.recv_count.counts"][1, 0, 0] = cfg.max_tokens_per_rank + 1
    with pytest.raises(EPOverflowError, match="rank 1: dispatch received more rows than its buffers hold"):
        impl.dispatch_recv(cfg=cfg, layout=layouts[1], bufs=sim.world.bufs[1], ws=sim.world.workspaces[1],
                           num_tokens=6)
    assert int(sim.world.workspaces[1].status.abs().sum()) == 0, "check_status clears the flags"
    # rank 0's own receive is unaffected
    h0 = impl.dispatch_recv(cfg=cfg, layout=layouts[0], bufs=sim.world.bufs[0], ws=sim.world.workspaces[0],
                            num_tokens=5)
    ref = reference.dispatch_world(cfg, inp.xs, inp.ids)
    assert h0.recv.row_offsets_L1.cpu().tolist() == ref[0].row_offsets.tolist()


def test_overflowing_expert_raises():
    # per-expert counts that add up past the receive capacity (the kernel checks the segment
    # total too; the twin only checks rows per source)
    cfg = make_cfg(2, "bf16", "bf16")
    sim = Sim(cfg, KERNEL)
    inp = make_round(cfg, [5, 6], seed=23)
    layouts = [D.dispatch_send(cfg=cfg, x_TH=inp.x_dev[r], topk_ids_TK=inp.ids_dev[r], topk_weights_TK=inp.w_dev[r],
                               bufs=sim.world.bufs[r], ws=sim.world.workspaces[r]) for r in range(2)]
    sim.world.bufs[0].local["dispatch.recv_count.counts"][1, 1, 1] = cfg.max_recv_rows + 1  # the first round's set
    with pytest.raises(EPOverflowError, match="rank 0"):
        D.dispatch_recv(cfg=cfg, layout=layouts[0], bufs=sim.world.bufs[0], ws=sim.world.workspaces[0], num_tokens=5)


# a short recv timeout: 50 polls in the interpreter, 50 ms on a GPU
TIMEOUT_S = 0.05
QUICK_S = 60.0 if device == "cpu" else 5.0  # a loose bound, for a slow shared CPU; the point is: no hang


@pytest.mark.parametrize("impl", [KERNEL, TWIN], ids=lambda i: i.name)
def test_missing_sender_times_out_in_dispatch(world_size, impl):
    R = world_size
    cfg = make_cfg(R, "bf16", "bf16", recv_timeout_s=TIMEOUT_S)
    sim = Sim(cfg, impl)
    silent = R - 1
    inp = make_round(cfg, tokens_for(R, 24, most=4), seed=24)
    layouts = [None] * R
    for r in range(R):
        if r != silent:
            layouts[r] = impl.dispatch_send(cfg=cfg, x_TH=inp.x_dev[r], topk_ids_TK=inp.ids_dev[r],
                                            topk_weights_TK=inp.w_dev[r], bufs=sim.world.bufs[r],
                                            ws=sim.world.workspaces[r])
    for r in range(R):
        start = time.monotonic()
        with pytest.raises(EPTimeoutError, match=rf"dispatch: rank\(s\) \[{silent}\] stayed silent: rank {r} timed out"):
            impl.dispatch_recv(cfg=cfg, layout=layouts[r], bufs=sim.world.bufs[r], ws=sim.world.workspaces[r],
                               num_tokens=inp.tokens[r])
        assert time.monotonic() - start < QUICK_S


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("impl", [KERNEL, TWIN], ids=lambda i: i.name)
def test_missing_sender_times_out_in_combine(impl, mode):
    R = 4
    cfg = make_cfg(R, "bf16", "fp32", recv_timeout_s=TIMEOUT_S, combine_mode=mode)
    sim = Sim(cfg, impl)
    inp = make_round(cfg, [3, 2, 4, 1], seed=25)
    handles = sim.dispatch(inp)
    ys = sim.run_experts(handles)
    silent = 1
    for r in range(R):
        if r != silent:
            impl.combine_send(cfg=cfg, y_MH=ys[r], handle=handles[r], bufs=sim.world.bufs[r],
                              ws=sim.world.workspaces[r])
    for r in range(R):
        start = time.monotonic()
        with pytest.raises(EPTimeoutError, match=rf"combine: rank\(s\) \[{silent}\] stayed silent: rank {r} timed out"):
            impl.combine_recv(cfg=cfg, handle=handles[r], bufs=sim.world.bufs[r], ws=sim.world.workspaces[r],
                              out_dtype=torch.float32)
        assert time.monotonic() - start < QUICK_S


# ---- the fused form: all ranks at once, GPU only -------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the fused kernels wait for their peers inside one launch, so every rank's launch "
                           "must run at the same time: separate CUDA streams give that, the interpreter "
                           "(one launch after another) cannot")
@pytest.mark.parametrize("dispatch,combine", [("bf16", "bf16"), ("fp8", "fp32"), ("nvfp4", "bf16")])
def test_fused_on_concurrent_streams(world_size, dispatch, combine):
    R = world_size
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    # every rank's programs resident at once (receive programs spin on their peers), with room to spare
    per_rank = max(1, min(4, sms // (2 * R)))
    # a generous timeout: the first launches compile while the peers' kernels already spin
    cfg = make_cfg(R, dispatch, combine, 4, num_sms=per_rank, recv_timeout_s=60.0)
    sim, twin = Sim(cfg, KERNEL), Sim(cfg, TWIN)
    streams = [torch.cuda.Stream() for _ in range(R)]
    # One split round on a world of its own first, one rank after the other: it loads the
    # modules and fills the allocator's cache. In one process, loading a module or a fresh
    # cudaMalloc can wait for running kernels, so a rank's host could stall behind the
    # other ranks' spinning fused kernels (one process per GPU never shares a device).
    warm = Sim(cfg, KERNEL)
    w_inp = make_round(cfg, tokens_for(R, 299, most=cfg.max_tokens_per_rank), seed=299)
    wh = warm.dispatch(w_inp)
    warm.combine(wh, warm.run_experts(wh), warm.shared(w_inp))
    torch.cuda.synchronize()
    for rnd in range(3):
        inp = make_round(cfg, tokens_for(R, 300 + rnd, most=cfg.max_tokens_per_rank), seed=300 + rnd)
        torch.cuda.synchronize()
        handles = [None] * R
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                handles[r] = D.dispatch_fused(cfg=cfg, x_TH=inp.x_dev[r], topk_ids_TK=inp.ids_dev[r],
                                        topk_weights_TK=inp.w_dev[r], bufs=sim.world.bufs[r],
                                        ws=sim.world.workspaces[r], out=sim.recv_out[r], check=False)
        torch.cuda.synchronize()
        for r in range(R):
            check_status(sim.world.workspaces[r], r, "dispatch")
        ref = check_dispatch(cfg, handles, inp)
        ys = sim.run_experts(handles)
        adds = sim.shared(inp)
        torch.cuda.synchronize()
        outs = [None] * R
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                outs[r] = C.combine_fused(cfg=cfg, y_MH=ys[r], handle=handles[r], bufs=sim.world.bufs[r],
                                    ws=sim.world.workspaces[r], out_dtype=out_dtype_of(cfg), add_TH=adds[r],
                                    check=False)
        torch.cuda.synchronize()
        for r in range(R):
            check_status(sim.world.workspaces[r], r, "combine")
        check_chain(cfg, inp, ref, ys, outs, adds)
        # the split twins on the same inputs agree
        th = twin.dispatch(inp)
        t_outs = twin.combine(th, twin.run_experts(th), twin.shared(inp))
        check_twins_agree(cfg, handles, th, outs, t_outs, sim, twin)
        for ws in sim.world.workspaces:
            assert ws.epochs.tolist() == [rnd + 1, rnd + 1]


# ---- the send's own layout against compute_layout --------------------------------------------
@pytest.mark.parametrize("T,routing,mask,budget", [(1, "uniform", 0.0, None), (37, "skewed", 0.3, None),
                                                   (256, "uniform", 0.1, None), (200, "one-expert", 0.0, None),
                                                   (257, "uniform", 0.1, None), (300, "skewed", 0.2, None),
                                                   (333, "one-expert", 0.0, None), (257, "uniform", 0.1, 3),
                                                   (300, "skewed", 0.2, 2), (600, "one-expert", 0.1, 4),
                                                   (700, "skewed", 0.0, 64)])
def test_send_lays_out_its_own_tokens_like_compute_layout(T, routing, mask, budget):
    """The send kernel works out slots, ordinals and totals itself: up to SELF_LAYOUT_MAX_T
    tokens by scanning every earlier token, beyond it from block_bases (scanning only its
    layout block), or under an SM budget chunk by chunk from count_chunks (64 programs: more
    than the blocks, so some chunks hold a single block). All must equal compute_layout's
    exactly (duplicated and masked ids included), and three sends in a row must leave the
    workspace totals at zero."""
    cfg = make_cfg(4, "bf16", "bf16", max_tokens_per_rank=max(T, 256), num_sms=budget)
    world = LocalWorld.create(cfg, device)
    for rnd in range(3):
        inp = make_round(cfg, [T, 0, 1, 2], seed=900 + rnd, routing=routing, mask=mask)
        ids = inp.ids_dev[0].clone()
        if T >= 2:  # a token naming one expert twice, as a careless router may
            ids[1, 1] = ids[1, 0]
        got = D.dispatch_send(cfg=cfg, x_TH=inp.x_dev[0], topk_ids_TK=ids, topk_weights_TK=inp.w_dev[0],
                              bufs=world.bufs[0], ws=world.workspaces[0])
        want = compute_layout_torch(topk_ids_TK=ids, world_size=4, experts_per_rank=cfg.experts_per_rank)
        for name in ("token_slots_TR", "ordinals_TK", "expert_counts_E", "rank_counts_R"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name).cpu()), name
        assert int(world.workspaces[0].totals.abs().sum()) == 0


def test_host_cdiv_and_next_power_of_2_are_tritons():
    # the launchers' own helpers: Triton's are constexpr functions, slow to call from host code
    from ray_ep.kernels._util import cdiv, next_power_of_2

    assert [next_power_of_2(n) for n in range(-3, 1100)] == [triton.next_power_of_2(n) for n in range(-3, 1100)]
    pairs = [(a, b) for a in range(0, 300) for b in (1, 2, 3, 7, 8, 32, 64, 128)]
    assert [cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]


@pytest.mark.parametrize("R,sum_channels", [(1, 8192), (2, 4096), (4, 4096), (8, 1024), (16, 512)])
def test_tiles_under_an_sm_budget(monkeypatch, R, sum_channels):
    # the GPU's tiles (the interpreter's are whole rows): without a budget one row per
    # program; under one a program fills its SM (8 rows, 32 warps) and each thread keeps
    # several 16-byte loads in flight, the combine's sum as wide as
    # its R rows allow without spills (combine.SUM_CHANNELS)
    from types import SimpleNamespace

    from ray_ep.kernels import _util

    monkeypatch.setattr(_util, "interpreted", lambda: False)
    cfg = EPConfig.preset("deepseek-v3", n_nodes=max(1, R // 8), gpus_per_node=min(R, 8), max_tokens_per_rank=1024)
    cpu = torch.device("cpu")
    assert _util.comm_tile(cfg.hidden_size, cpu, None, "dispatch", multiple=FP8_GROUP) == (1, 1024, 4)
    assert _util.comm_tile(cfg.hidden_size, cpu, 24, "dispatch", multiple=FP8_GROUP) == (8, 2048, 32)
    rows, send, summed, warps = C._tile(cfg, SimpleNamespace(device=cpu), 24, 4096)
    assert (rows, send["BLOCK_H"], summed["BLOCK_HS"], warps) == (8, 1024, sum_channels, 32)
    assert send["R_PAD"] == summed["R_PAD"] == R
    rows, send, summed, warps = C._tile(cfg, SimpleNamespace(device=cpu), None, 4096)
    assert (rows, send["BLOCK_H"], summed["BLOCK_HS"], warps) == (1, 1024, 1024, 4)
    # a token per SM or fewer (decode; the CPU stands in for 4 SMs): a combine program takes
    # 4096 channels of its row per step, 16 warps, a send 2048 at 8 warps; an SM budget keeps
    # its tile
    rows, send, summed, warps = C._tile(cfg, SimpleNamespace(device=cpu), None, 4)
    assert (rows, send["BLOCK_H"], summed["BLOCK_HS"], warps) == (1, 4096, 4096, 16)
    assert C._tile(cfg, SimpleNamespace(device=cpu), 24, 4)[3] == 32
    # a combine keeps that tile up to two tokens per SM, a send only to one
    assert C._tile(cfg, SimpleNamespace(device=cpu), None, 8)[:3] == (1, {"BLOCK_H": 4096, "R_PAD": R},
                                                                       {"BLOCK_HS": 4096, "R_PAD": R})
    assert C._tile(cfg, SimpleNamespace(device=cpu), None, 9)[1]["BLOCK_H"] == 1024
    assert _util.comm_tile(cfg.hidden_size, cpu, None, "dispatch", tokens=4) == (1, 2048, 8)
    assert D._send_tile(cfg.model_copy(update={"dispatch_dtype": "fp8"}), cpu, None, 4) == (1, 2048, 8)
    assert D._send_tile(cfg, cpu, None, 5) == (1, 1024, 4)  # more tokens than SMs
    assert D._send_tile(cfg, cpu, 24, 4) == (8, 2048, 32)
    # a narrow model takes its whole row per step
    assert _util.comm_tile(256, cpu, 24, "combine", channels=4096) == (8, 256, 32)


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_quantising_sends_take_steps_that_divide_h(monkeypatch, dtype):
    # a thread pays for its step's channels past H too: deepseek-v3's 7168 channels are 3.5
    # steps of 2048, so nvfp4's send under a budget that binds it by its SMs halves its step
    # and doubles its rows (the same threads), and so it does with every SM; decode keeps its
    # wide steps. Past that budget (budget x (R - 1) / R > 12) the wide steps stay. fp8's send
    # keeps 8 rows x 2048 under every budget (its 16-row whole steps failed checks on 4x H200)
    from ray_ep.kernels import _util

    monkeypatch.setattr(_util, "interpreted", lambda: False)
    monkeypatch.setattr(D, "interpreted", lambda: False)
    cfg = EPConfig.preset("deepseek-v3", gpus_per_node=4, dispatch_dtype=dtype, max_tokens_per_rank=4096)
    cpu = torch.device("cpu")  # a GPU of 4 SMs, as above
    budget_tile = {"fp8": (8, 2048, 32), "nvfp4": (16, 1024, 16)}[dtype]
    wide_tile = {"fp8": (8, 2048, 32), "nvfp4": (8, 2048, 16)}[dtype]
    assert D._send_tile(cfg, cpu, 16, 4096) == D._send_tile(cfg, cpu, 16) == budget_tile
    assert D._send_tile(cfg, cpu, 20, 4096) == D._send_tile(cfg, cpu, 24) == wide_tile
    two = cfg.model_copy(update={"gpus_per_node": 2})
    assert D._send_tile(two, cpu, 24, 4096) == budget_tile
    assert D._send_tile(two, cpu, 25, 4096) == wide_tile
    # a batch too small to give every program of the budget whole-step blocks keeps the
    # wide steps: 128 tokens make 16 blocks of 8 rows or 8 of 16 (on 24 SMs, 16 programs idle)
    assert D._send_tile(two, cpu, 24, 128) == wide_tile
    assert D._send_tile(two, cpu, 8, 128) == budget_tile
    # fp8 rows are read as words with every SM and under a budget that binds the send by its
    # SMs, as elements past it; nvfp4's always as words (aligned rows)
    x = torch.zeros(8, cfg.hidden_size, dtype=torch.bfloat16)
    words, elements = D.READ_WORDS.value, D.READ_ELEMENTS.value
    expected = {None: words, 16: words, 24: words if dtype == "nvfp4" else elements}
    assert {b: D._read_mode(cfg, x, dtype, b) for b in expected} == expected
    assert D._read_mode(two, x, dtype, 24) == words
    assert D._read_mode(cfg, x[:, 1:], dtype, 16) == elements  # rows that start at odd bf16 offsets
    assert D._send_tile(cfg, cpu, None, 4096) == {"fp8": (1, 1024, 4), "nvfp4": (2, 1024, 2)}[dtype]
    assert D._send_tile(cfg, cpu, None, 4) == {"fp8": (1, 2048, 8), "nvfp4": (1, 4096, 4)}[dtype]
    # a hidden size that a wide step divides keeps it; bf16 keeps its tile
    wide = cfg.model_copy(update={"hidden_size": 4096})
    assert D._send_tile(wide, cpu, 24, 4096) == {"fp8": (8, 2048, 32), "nvfp4": (8, 2048, 16)}[dtype]
    assert D._send_tile(cfg.model_copy(update={"dispatch_dtype": "bf16"}), cpu, 24, 4096) == (8, 2048, 32)


@triton.jit
def _pairs_round_trip_kernel(x_ptr, out_ptr, H, BP: tl.constexpr):
    pairs = tl.arange(0, BP)[None, :]
    even, odd = unpack_pairs(tl.load(pair_ptr(x_ptr) + pairs, mask=pairs < H // 2, other=0))
    cols = tl.arange(0, 2 * BP)[None, :]
    tl.store(out_ptr + cols, join_pairs(even, odd), mask=cols < H)


def test_bf16_pairs_unpack_to_their_fp32_values_in_channel_order():
    """The combine's send under an SM budget reads bf16 rows two channels per int32
    (kernels/pairs.py): every bf16, specials included, must come back as its fp32 value, in
    its channel's place."""
    H = 200  # not a power of two: masked pairs at the end
    x = torch.randn(H, generator=torch.Generator().manual_seed(5)) * 1e3
    x[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, -3.0])  # 1e-40: subnormal
    x = x.to(torch.bfloat16).to(device)
    out = torch.full((H,), 7.0, device=device)
    _pairs_round_trip_kernel[(1,)](x, out, H, BP=triton.next_power_of_2(H // 2))
    assert torch.equal(out.view(torch.int32), x.float().view(torch.int32))


# ---- the Hopper combine send (kernels/combine_sm90.py), GPU only ------------------------------
def _dispatched_world(cfg: EPConfig, tokens: list[int], seed: int, routing: str = "uniform"):
    """(a LocalWorld on this device, each rank's dispatch handle) after one dispatch of random
    tokens (``tokens`` per rank) on it."""
    world = LocalWorld.create(cfg, device)
    xs, ids, ws = make_inputs(cfg, tokens, seed=seed, routing=routing)
    layouts = [D.dispatch_send(cfg=cfg, x_TH=xs[r].to(device), topk_ids_TK=ids[r].to(device),
                               topk_weights_TK=ws[r].to(device), bufs=world.bufs[r], ws=world.workspaces[r])
               for r in range(cfg.world_size)]
    handles = [D.dispatch_recv(cfg=cfg, layout=layouts[r], bufs=world.bufs[r], ws=world.workspaces[r],
                               num_tokens=tokens[r]) for r in range(cfg.world_size)]
    return world, handles


HOPPER_SEND_CASES = [(2, 7168, "uniform"), (4, 7168, "skewed"), (2, 16384, "skewed"), (4, 192, "uniform")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon send runs on Hopper GPUs only (elsewhere the Triton send runs)")
@pytest.mark.parametrize("R,hidden,routing", HOPPER_SEND_CASES, ids=[f"R{r}-H{h}-{x}" for r, h, x in HOPPER_SEND_CASES])
def test_hopper_combine_send_gives_the_triton_sends_bits(monkeypatch, R, hidden, routing):
    """Under an SM budget on Hopper the combine's send is the Gluon kernel: every rank's partial
    rows on every peer bit for bit those of the Triton send (the same products added in the
    same order), for rows of one chunk (7168), of two (16384) and of boxes of 64 channels (192);
    skewed routing, a rank with one token and one with none; within the budget."""
    from ray_ep.kernels import combine_sm90

    budget = 8
    cfg = EPConfig.preset("deepseek-v3", gpus_per_node=R, hidden_size=hidden, max_tokens_per_rank=256)
    tokens = [256, 1, 0, 200][:R]
    world, handles = _dispatched_world(cfg, tokens, seed=41, routing=routing)
    g = torch.Generator(device=device).manual_seed(42)
    ys = [torch.randn(cfg.max_recv_rows, hidden, device=device, generator=g).to(torch.bfloat16) for _ in range(R)]

    def sent(r: int, hopper: bool) -> list[torch.Tensor]:
        """Rank r's partial rows on every peer after its send (the rows start as NaN)."""
        monkeypatch.setattr(combine_sm90, "usable", usable if hopper else (lambda *a, **k: False))
        for s in range(R):
            world.bufs[s].local["combine.recv.x"].fill_(float("nan"))
        with recorded_launches() as launches:
            C.combine_send(cfg=cfg, y_MH=ys[r], handle=handles[r], bufs=world.bufs[r], ws=world.workspaces[r],
                           num_sms=budget)
        torch.cuda.synchronize()
        assert [x.kernel for x in launches] == ["_combine_send_sm90_kernel" if hopper else "_combine_send_kernel"]
        assert all(x.programs <= budget for x in launches)
        return [world.bufs[s].local["combine.recv.x"][r][:int(handles[r].recv.recv_counts_R[s])].clone()
                for s in range(R)]

    usable = combine_sm90.usable
    for r in range(R):
        want, got = sent(r, hopper=False), sent(r, hopper=True)
        for s in range(R):
            assert not got[s].isnan().any(), (r, s)
            assert torch.equal(got[s], want[s]), (r, s, (got[s] != want[s]).sum().item())


OVERLAP_CASES = [(2, 7168, "uniform"), (4, 7168, "skewed"), (4, 192, "uniform")]


def test_every_rank_sums_beside_the_send_or_none_does(monkeypatch):
    """The sum beside the Gluon send waits for blocks that every rank's send flags, and the
    other combine forms flag none: whether a fused combine takes that form depends on the
    configuration and the device, never on the rank's own tokens (a rank of few tokens taking
    the one-launch form left its peers waiting: 4x H200, the two-micro-batch layer at 24 SMs)."""
    from ray_ep.kernels import combine_sm90

    R = 4
    monkeypatch.setattr(combine_sm90, "usable_for", lambda *a, **k: True)  # as on a Hopper GPU
    taken: list[tuple[int, str]] = []
    monkeypatch.setattr(C, "_overlapped_combine", lambda **k: taken.append((k["bufs"].rank, "beside")))
    monkeypatch.setattr(C, "launch", lambda kernel, **k: taken.append((k["args"]["rank"], kernel.fn.__name__)))
    sms = num_sms(device)
    for max_tokens, beside in ((sms + 60, True), (sms, False)):  # prefill-sized, decode-sized batches
        cfg = EPConfig.preset("tiny", gpus_per_node=R, max_tokens_per_rank=max_tokens)
        tokens = [max_tokens, 1, 0, 3]  # more tokens than SMs on one rank only
        world, handles = _dispatched_world(cfg, tokens, seed=46)
        y = torch.zeros(cfg.max_recv_rows, cfg.hidden_size, dtype=torch.bfloat16, device=device)
        taken.clear()
        for r in range(R):
            C.combine_fused(cfg=cfg, y_MH=y, handle=handles[r], bufs=world.bufs[r], ws=world.workspaces[r],
                            num_sms=C.OVERLAP_MIN_SMS, check=False)
        forms = {r: {f for q, f in taken if q == r} for r in range(R)}
        assert all(forms[r] == ({"beside"} if beside else {"_combine_fused_kernel"}) for r in range(R)), forms


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the sum beside the Gluon send runs on Hopper GPUs only")
@pytest.mark.parametrize("R,hidden,routing", OVERLAP_CASES, ids=[f"R{r}-H{h}-{x}" for r, h, x in OVERLAP_CASES])
def test_hopper_sum_beside_the_send_gives_the_serial_combines_bits(monkeypatch, R, hidden, routing):
    """Under an SM budget on Hopper the fused combine's sum runs beside the Gluon send, each
    block of tokens waiting for the flags of the rows it adds: launched before any send (so it
    must wait), on fewer SMs than the send, it gives every rank's output bit for bit as the
    Triton send and the signalled sum do (the same rows added in the same order), with the
    shared-expert rows added; a rank with one token and one with none."""
    from ray_ep.kernels import combine_sm90

    budget = 8
    sum_sms = C.overlap_sum_sms(budget)
    assert 1 <= sum_sms < budget
    cfg = EPConfig.preset("deepseek-v3", gpus_per_node=R, hidden_size=hidden, max_tokens_per_rank=256)
    tokens = [256, 1, 0, 200][:R]
    world, handles = _dispatched_world(cfg, tokens, seed=43, routing=routing)
    g = torch.Generator(device=device).manual_seed(44)
    ys = [torch.randn(cfg.max_recv_rows, hidden, device=device, generator=g).to(torch.bfloat16) for _ in range(R)]
    adds = [torch.randn(tokens[r], hidden, device=device, generator=g).to(torch.bfloat16) for r in range(R)]
    common = [dict(cfg=cfg, handle=handles[r], bufs=world.bufs[r], ws=world.workspaces[r]) for r in range(R)]

    monkeypatch.setattr(combine_sm90, "usable", lambda *a, **k: False)  # the Triton send, then the sum
    for r in range(R):
        C.combine_send(y_MH=ys[r], num_sms=budget, **common[r])
    want = [C.combine_recv(add_TH=adds[r], num_sms=budget, **common[r]) for r in range(R)]

    def fresh() -> list[torch.Tensor]:
        for r in range(R):
            world.bufs[r].local["combine.recv.x"].fill_(float("nan"))
        return [torch.full((tokens[r], hidden), float("nan"), dtype=torch.bfloat16, device=device) for r in range(R)]

    outs = fresh()  # first the sends, then the sums (this compiles both before a sum spins)
    for r in range(R):
        C._send_sm90(y_MH=ys[r], budget=budget - sum_sms, flags=True, **common[r])
    for r in range(R):
        C._launch_recv(out=outs[r], add_TH=adds[r], budget=sum_sms, flags=True, **common[r])
        check_status(world.workspaces[r], r, "combine")
        assert torch.equal(outs[r], want[r]), (r, (outs[r] != want[r]).sum().item())
    outs = fresh()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with recorded_launches() as launches:
        with torch.cuda.stream(side):  # every sum waits before a row is sent
            for r in range(R):
                C._launch_recv(out=outs[r], add_TH=adds[r], budget=sum_sms, flags=True, **common[r])
        for r in range(R):
            C._send_sm90(y_MH=ys[r], budget=budget - sum_sms, flags=True, **common[r])
    torch.cuda.synchronize()
    for r in range(R):
        check_status(world.workspaces[r], r, "combine")
        assert torch.equal(outs[r], want[r]), (r, (outs[r] != want[r]).sum().item())
    sends = [x.programs for x in launches if x.kernel == "_combine_send_sm90_kernel"]
    sums = [x.programs for x in launches if x.kernel == "_combine_recv_kernel"]
    assert sends == [budget - sum_sms] * R and len(sums) == R and max(sums) == sum_sms  # fewer for fewer tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the sum beside the Gluon send runs on Hopper GPUs only")
def test_hopper_sum_beside_the_send_times_out_on_a_silent_rank():
    """The sum that waits for the Gluon send's flags names a rank whose rows never come, in
    time, as the signalled sum does."""
    R, budget = 4, 8
    cfg = EPConfig.preset("deepseek-v3", gpus_per_node=R, max_tokens_per_rank=64, recv_timeout_s=TIMEOUT_S)
    tokens = [64, 40, 64, 17]
    world, handles = _dispatched_world(cfg, tokens, seed=45)
    y = torch.randn(cfg.max_recv_rows, cfg.hidden_size, device=device).to(torch.bfloat16)
    sum_sms = C.overlap_sum_sms(budget)
    silent = 2
    for r in range(R):
        if r != silent:
            C._send_sm90(cfg, y, handles[r], world.bufs[r], world.workspaces[r], budget - sum_sms, flags=True)
    for r in range(R):
        out = torch.empty(tokens[r], cfg.hidden_size, dtype=torch.bfloat16, device=device)
        start = time.monotonic()
        C._launch_recv(cfg, handles[r], world.bufs[r], world.workspaces[r], out, None, sum_sms, flags=True)
        with pytest.raises(EPTimeoutError, match=rf"combine: rank\(s\) \[{silent}\] stayed silent: rank {r} timed out"):
            check_status(world.workspaces[r], r, "combine")
        assert time.monotonic() - start < QUICK_S
