"""compute_layout (Triton) against its torch twin compute_layout_torch: every output exactly.

Without CUDA the kernels run in Triton's CPU interpreter; with CUDA the same tests run compiled.
Legend: T tokens, K top-k, R ranks, L local experts per rank, E = R * L.
"""

import os

import torch

if not torch.cuda.is_available():
    # must precede the first import of triton: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ray_ep.errors import EPInputError  # noqa: E402
from ray_ep.types import DispatchLayout  # noqa: E402
from ray_ep.kernels._util import num_sms, recorded_launches  # noqa: E402
from ray_ep.kernels.layout import (ASSIGN_TOKENS, block_bases, block_bases_torch, block_tokens,  # noqa: E402
                                  compute_layout, compute_layout_torch)

device = "cuda" if torch.cuda.is_available() else "cpu"
# triton 3.6's interpreter turns 1-element arrays into Python ints through a numpy path that
# numpy >= 1.25 deprecates (one warning per kernel-side index): noise, not a finding
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

FIELDS = ("token_slots_TR", "ordinals_TK", "expert_counts_E", "rank_counts_R")


def random_ids(T, K, E, gen, masked=0.0, out_of_range=0.0):
    """[T, K] int32: K distinct experts per token; a fraction ``masked`` of the slots set to -1
    and a fraction ``out_of_range`` to ids outside [0, E) (both must be treated as unused)."""
    ids = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices.to(torch.int32)
    u = torch.rand(T, K, generator=gen)
    ids[u < masked] = -1
    bad = torch.tensor([E, E + 7, -2, -1000, 2**30], dtype=torch.int32)
    pick = torch.randint(0, bad.numel(), (T, K), generator=gen)
    oor = (u >= masked) & (u < masked + out_of_range)
    ids[oor] = bad[pick[oor]]
    return ids


def check_equal(ids_TK, R, L, num_sms=None):
    """Kernel and twin on ``ids_TK``; every field equal (dtype int32, on the ids' device)."""
    got = compute_layout(topk_ids_TK=ids_TK, world_size=R, experts_per_rank=L, num_sms=num_sms)
    want = compute_layout_torch(topk_ids_TK=ids_TK, world_size=R, experts_per_rank=L)
    T, K = ids_TK.shape
    shapes = {"token_slots_TR": (T, R), "ordinals_TK": (T, K), "expert_counts_E": (R * L,), "rank_counts_R": (R,)}
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == torch.int32 and w.dtype == torch.int32, name
        assert tuple(g.shape) == shapes[name] and tuple(w.shape) == shapes[name], name
        assert g.device == ids_TK.device, name
        assert torch.equal(g, w), f"{name} differs:\nkernel {g.tolist()}\ntwin   {w.tolist()}"
    return got


def check_semantics(layout: DispatchLayout, ids_TK, R, L):
    """A plain loop over tokens: the definition in the module docstring."""
    ids = ids_TK.cpu().tolist()
    E = R * L
    per_expert, per_rank = [0] * E, [0] * R
    slots = [[-1] * R for _ in ids]
    ordinals = [[-1] * len(row) for row in ids]
    for t, row in enumerate(ids):
        ranks = set()
        for k, e in enumerate(row):
            if 0 <= e < E:
                ordinals[t][k] = per_expert[e]
                per_expert[e] += 1
                ranks.add(e // L)
        for d in sorted(ranks):
            slots[t][d] = per_rank[d]
            per_rank[d] += 1
    assert layout.token_slots_TR.cpu().tolist() == slots
    assert layout.ordinals_TK.cpu().tolist() == ordinals
    assert layout.expert_counts_E.cpu().tolist() == per_expert
    assert layout.rank_counts_R.cpu().tolist() == per_rank


def test_docstring_example():
    ids = torch.tensor([[0, 3], [1, 0], [2, -1]], dtype=torch.int32, device=device)
    got = check_equal(ids, R=2, L=2)
    assert got.token_slots_TR.tolist() == [[0, 0], [1, -1], [-1, 1]]
    assert got.ordinals_TK.tolist() == [[0, 0], [0, 1], [0, -1]]
    assert got.expert_counts_E.tolist() == [2, 1, 1, 1]
    assert got.rank_counts_R.tolist() == [2, 2]


# (R, L, K): K <= E; L = 1 puts one expert per rank, K > L spreads a token over ranks
SHAPES = [(1, 4, 2), (2, 2, 4), (3, 5, 4), (4, 4, 1), (8, 2, 4), (8, 16, 8)]
# T: none, one, one partial block, exactly one interpreter block (64), several blocks
# (> 64 tokens: the count and assign launches run in the interpreter too)
TOKENS = [0, 1, 7, 64, 65, 200]


@pytest.mark.parametrize("T", TOKENS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("R,L,K", SHAPES, ids=[f"R{r}-L{l}-K{k}" for r, l, k in SHAPES])
def test_random_ids(R, L, K, T):
    gen = torch.Generator().manual_seed(100 * R + 10 * L + K + 1000 * T)
    ids = random_ids(T, K, R * L, gen).to(device)
    got = check_equal(ids, R, L)
    check_semantics(got, ids, R, L)
    # every used slot counted once; a token goes at most once to each rank
    assert int(got.expert_counts_E.sum()) == T * K
    assert int(got.rank_counts_R.sum()) == int((got.token_slots_TR >= 0).sum())


@pytest.mark.parametrize("T", [1, 9, 150], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("R,L,K", [(2, 2, 4), (3, 5, 4), (8, 2, 4)], ids=["R2-L2-K4", "R3-L5-K4", "R8-L2-K4"])
def test_masked_and_out_of_range_ids_are_unused(R, L, K, T):
    gen = torch.Generator().manual_seed(7 + R + T)
    ids = random_ids(T, K, R * L, gen, masked=0.3, out_of_range=0.2).to(device)
    got = check_equal(ids, R, L)
    check_semantics(got, ids, R, L)
    unused = (ids < 0) | (ids >= R * L)
    assert bool((got.ordinals_TK[unused] == -1).all())
    assert int(got.expert_counts_E.sum()) == int((~unused).sum())


def test_all_slots_masked():
    ids = torch.full((70, 4), -1, dtype=torch.int32, device=device)
    got = check_equal(ids, R=4, L=4)
    assert bool((got.token_slots_TR == -1).all()) and bool((got.ordinals_TK == -1).all())
    assert got.expert_counts_E.abs().sum() == 0 and got.rank_counts_R.abs().sum() == 0


def test_all_tokens_to_one_expert():
    T, R, L = 130, 4, 4
    ids = torch.full((T, 3), -1, dtype=torch.int32, device=device)
    ids[:, 1] = 9  # expert 9 = rank 2, local expert 1
    got = check_equal(ids, R, L)
    assert got.ordinals_TK[:, 1].tolist() == list(range(T))
    assert got.token_slots_TR[:, 2].tolist() == list(range(T))
    assert got.rank_counts_R.tolist() == [0, 0, T, 0]


def test_many_blocks_and_columns():
    # E + R = 136 counters; T = 4227 spans 67 blocks (64 tokens per block in the interpreter
    # and for E = 128 on a GPU), so each block sums the counts of the blocks before it over
    # several row chunks
    R, L, K, T = 8, 16, 8, 4227
    gen = torch.Generator().manual_seed(11)
    ids = random_ids(T, K, R * L, gen, masked=0.1, out_of_range=0.05).to(device)
    check_equal(ids, R, L)


@pytest.mark.parametrize("num_sms", [1, 3])
def test_sm_budget_caps_every_launch(num_sms):
    """Under an SM budget (a dispatch's num_sms) each layout launch takes at most that many
    programs, each looping over several blocks (here 9 blocks of tokens, 5 column groups of
    the scan), and the layout is the same."""
    R, L, K = 4, 32, 8
    T = 8 * ASSIGN_TOKENS + 3
    gen = torch.Generator().manual_seed(num_sms)
    ids = random_ids(T, K, R * L, gen, masked=0.1).to(device)
    with recorded_launches() as launches:
        check_semantics(check_equal(ids, R, L, num_sms=num_sms), ids, R, L)
    assert [r.kernel for r in launches] == ["_chunk_count_kernel", "_chunk_assign_kernel"]
    assert all(r.programs == num_sms for r in launches), launches


def test_wide_top_k_under_an_sm_budget():
    """Top-16 over the assign's 64-token blocks: 1024 sorted (expert, token, k) keys a block."""
    R, L, K = 2, 16, 16
    T = 2 * ASSIGN_TOKENS + 5
    gen = torch.Generator().manual_seed(16)
    ids = random_ids(T, K, R * L, gen, masked=0.1).to(device)
    check_semantics(check_equal(ids, R, L, num_sms=2), ids, R, L)


@pytest.mark.parametrize("num_sms,K", [(None, 4), (2, 4), (2, 6)], ids=["all-sms-K4", "2sms-K4", "2sms-K6"])
def test_an_expert_twice_in_a_token(num_sms, K):
    """A token may list an expert twice: both entries count, and both get the row of the
    tokens before it (the twin's rule), in the assign's sorted keys too; unused ids mixed in
    (and, at top-6, the padding entries of K_PAD = 8)."""
    R, L = 2, 3
    T = 2 * ASSIGN_TOKENS + 9
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, R * L, (T, K), generator=gen, dtype=torch.int32)
    ids[torch.rand(T, K, generator=gen) < 0.1] = -1
    ids[torch.rand(T, K, generator=gen) < 0.05] = R * L + 1
    assert bool((ids[:, :, None] == ids[:, None, :]).sum((1, 2)).gt(K).any())  # some token repeats one
    got = check_equal(ids.to(device), R, L, num_sms=num_sms)
    assert int(got.expert_counts_E.sum()) == int(((ids >= 0) & (ids < R * L)).sum())


def test_many_chunks():
    """More chunks than the assign kernel sums at once (8 rows of counts per step): each
    program's base rows come from several steps; a budget above the chunks takes one program
    per chunk."""
    R, L, K = 4, 8, 4
    T = 20 * ASSIGN_TOKENS - 5
    gen = torch.Generator().manual_seed(5)
    ids = random_ids(T, K, R * L, gen, masked=0.1).to(device)
    with recorded_launches() as launches:
        check_semantics(check_equal(ids, R, L, num_sms=37), ids, R, L)
    assert [r.programs for r in launches] == [min(20, num_sms(device))] * 2  # 4 stand-ins on a CPU


@pytest.mark.parametrize("T", [0, 1, 16, 17, 150, 1000])
def test_block_bases(T):
    """Bases of each layout block (rows of the earlier blocks per expert and rank) and the
    totals: kernel, twin and a plain loop agree."""
    R, L, K = 4, 8, 4
    gen = torch.Generator().manual_seed(T)
    ids = random_ids(T, K, R * L, gen, masked=0.1, out_of_range=0.05).to(device)
    bases, totals = block_bases(topk_ids_TK=ids, world_size=R, experts_per_rank=L)
    want_b, want_t = block_bases_torch(topk_ids_TK=ids, world_size=R, experts_per_rank=L)
    assert torch.equal(bases.cpu(), want_b.cpu()) and torch.equal(totals.cpu(), want_t.cpu())
    bt = block_tokens()
    assert bases.shape == (max(1, -(-T // bt)), R * L + R)
    run = [0] * (R * L + R)
    for t, row in enumerate(ids.cpu().tolist()):
        if t % bt == 0:
            assert bases[t // bt].tolist() == run, t
        ranks = set()
        for e in row:
            if 0 <= e < R * L:
                run[e] += 1
                ranks.add(e // L)
        for r in ranks:
            run[R * L + r] += 1
    assert totals.tolist() == run


@pytest.mark.parametrize("T", [40, 1100, 9000])
def test_block_bases_with_the_gpu_scan_tile(T, monkeypatch):
    """block_bases with the GPU's blocks and scan tile (4 columns a program, up to 512 rows a
    tile) wherever the suite runs: 9000 tokens are 563 blocks, so the scan carries its sums
    from one row tile to the next."""
    import ray_ep.kernels.layout as layout_mod

    monkeypatch.setattr(layout_mod, "interpreted", lambda: False)
    assert block_tokens() == 16
    B = -(-T // 16)
    bc, br, _ = layout_mod._scan_tile(B)
    assert bc == 4 and (br < B) == (T == 9000)
    R, L, K = 2, 4, 4
    gen = torch.Generator().manual_seed(T)
    ids = random_ids(T, K, R * L, gen, masked=0.1).to(device)
    bases, totals = block_bases(topk_ids_TK=ids, world_size=R, experts_per_rank=L)
    want_b, want_t = block_bases_torch(topk_ids_TK=ids, world_size=R, experts_per_rank=L)
    assert bases.shape == (B, R * L + R)
    assert torch.equal(bases.cpu(), want_b.cpu()) and torch.equal(totals.cpu(), want_t.cpu())


@pytest.mark.parametrize("T", [5, 100], ids=lambda t: f"T{t}")
def test_non_contiguous_ids(T):
    # a column slice of a wider tensor: row stride 7, inner dim contiguous
    R, L, K = 4, 4, 4
    gen = torch.Generator().manual_seed(T)
    wide = random_ids(T, 7, R * L, gen, masked=0.1).to(device)
    ids = wide[:, 2:2 + K]
    assert not ids.is_contiguous() and ids.stride() == (7, 1)
    got = check_equal(ids, R, L)
    want = compute_layout_torch(topk_ids_TK=ids.contiguous(), world_size=R, experts_per_rank=L)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    check_semantics(got, ids, R, L)


@pytest.mark.parametrize(
    "ids,match",
    [
        (torch.zeros(4, 2, dtype=torch.int64), "topk_ids_TK must be int32"),
        (torch.zeros(4, 2, dtype=torch.float32), "topk_ids_TK must be int32"),
        (torch.zeros(8, dtype=torch.int32), "topk_ids_TK must have 2 dimensions"),
        (torch.zeros(2, 4, dtype=torch.int32).t(), "contiguous last dimension"),
        ([[0, 1]], "topk_ids_TK must be a torch.Tensor"),
    ],
    ids=["int64", "float32", "1-D", "transposed", "list"],
)
@pytest.mark.parametrize("fn", [compute_layout, compute_layout_torch], ids=["kernel", "twin"])
def test_bad_ids_raise(fn, ids, match):
    if isinstance(ids, torch.Tensor):
        ids = ids.to(device)
    with pytest.raises(EPInputError, match=match):
        fn(topk_ids_TK=ids, world_size=2, experts_per_rank=2)


@pytest.mark.parametrize("fn", [compute_layout, compute_layout_torch], ids=["kernel", "twin"])
def test_bad_topology_raises(fn):
    ids = torch.zeros(3, 2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="must be positive"):
        fn(topk_ids_TK=ids, world_size=0, experts_per_rank=2)


def test_too_many_experts_for_the_sorted_keys_raises():
    # keys (E + 1) x 64 tokens x 8 below 2^31: up to 2^22 - 2 experts
    ids = torch.zeros(3, 8, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="supports up to 4194302 experts at top-8, got 4194303"):
        compute_layout(topk_ids_TK=ids, world_size=1, experts_per_rank=2**22 - 1)
