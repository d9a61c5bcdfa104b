"""EPConfig validation, presets, file loading, derived sizes and the BufferPlan layout.

Every validation rule has a test that checks three things in the message: the field, the bad
value and what to change. Expected sizes are written out by hand from the documented layout
rule (docs/design.md, config.plan_buffers docstring), never by calling the code under test.
"""

import json
import math

import pydantic
import pytest

from ray_ep.config import (ALIGN_BYTES, DTYPE_BYTES, PRESETS, BufferPlan, EPConfig, describe_config_error,
                           nvfp4_row_bytes, parse_topology, plan_buffers, plan_memory)

# The smallest valid topology: one rank, 16 experts. Tests override single fields of it.
BASE = dict(hidden_size=128, n_experts=16, top_k=4, max_tokens_per_rank=32, intermediate_size=64)


def make(**overrides) -> EPConfig:
    return EPConfig(**{**BASE, **overrides})


def invalid(*fragments: str, **overrides) -> pydantic.ValidationError:
    """Build a config that must fail; every fragment must appear in the error message."""
    with pytest.raises(pydantic.ValidationError) as info:
        make(**overrides)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} missing from the message:\n{msg}"
    return info.value


# ---- validation rules ----------------------------------------------------------------------
def test_base_is_valid():
    cfg = make()
    assert (cfg.world_size, cfg.experts_per_rank) == (1, 16)


@pytest.mark.parametrize("n_nodes, gpus_per_node, n_experts", [(1, 4, 6), (1, 8, 12), (3, 2, 16), (2, 3, 8)])
def test_n_experts_divisible_by_world_size(n_nodes, gpus_per_node, n_experts):
    R = n_nodes * gpus_per_node
    invalid(
        f"n_experts (E) = {n_experts}",  # field and bad value
        f"{n_nodes} * {gpus_per_node} = {R}",  # how R was formed
        "must be divisible by the world size",  # the rule
        "change n_experts or the topology",  # the fix
        n_nodes=n_nodes, gpus_per_node=gpus_per_node, n_experts=n_experts,
    )


@pytest.mark.parametrize("n_nodes, gpus_per_node, n_experts", [(1, 8, 16), (2, 8, 16), (3, 2, 12), (4, 1, 4)])
def test_n_experts_divisible_passes(n_nodes, gpus_per_node, n_experts):
    cfg = make(n_nodes=n_nodes, gpus_per_node=gpus_per_node, n_experts=n_experts, top_k=2)
    assert cfg.experts_per_rank * cfg.world_size == n_experts


def test_top_k_at_most_n_experts():
    invalid("top_k (K) = 17", "must be <= n_experts (E) = 16", "distinct", top_k=17)
    assert make(top_k=16).top_k == 16  # boundary: K == E is allowed


def test_gpus_per_node_at_most_8():
    invalid("gpus_per_node = 9", "exceeds 8", "use n_nodes", gpus_per_node=9, n_experts=18)
    invalid("gpus_per_node = 16", "exceeds 8", "use n_nodes", gpus_per_node=16)
    assert make(gpus_per_node=8).world_size == 8


def test_fp8_needs_hidden_multiple_of_128():
    # 192 keeps bf16 combine rows 16-byte aligned, so only the fp8 rule can fire
    invalid("dispatch_dtype 'fp8'", "hidden_size % 128 == 0", "hidden_size = 192", "use bf16 or pad H",
            dispatch_dtype="fp8", hidden_size=192)
    assert make(dispatch_dtype="fp8", hidden_size=256).dispatch_dtype == "fp8"


@pytest.mark.parametrize("field,value", [("hidden_size", 192), ("intermediate_size", 64)])
def test_fp8_experts_need_reduction_dims_multiple_of_128(field, value):
    # H is the reduction dim of gate_up, F of down: one weight scale per 128 x 128 block
    invalid("expert_dtype 'fp8'", f"{field} % 128 == 0", f"{field} = {value}", "use expert_dtype 'bf16'",
            expert_dtype="fp8", **{"hidden_size": 256, "intermediate_size": 128, field: value})
    assert make(expert_dtype="fp8", hidden_size=256, intermediate_size=128).expert_dtype == "fp8"
    assert make().expert_dtype == "bf16"  # the default


@pytest.mark.parametrize("hidden_size", [8, 24, 40, 136])
def test_nvfp4_needs_hidden_multiple_of_16(hidden_size):
    # one e4m3 scale per 16 channels; bf16 combine rows of these H are 16-byte aligned
    invalid("dispatch_dtype 'nvfp4'", "hidden_size % 16 == 0", f"hidden_size = {hidden_size}", "use bf16 or pad H",
            dispatch_dtype="nvfp4", hidden_size=hidden_size)


@pytest.mark.parametrize("hidden_size", [16, 48, 80, 208])
def test_nvfp4_rows_need_hidden_multiple_of_32(hidden_size):
    # H / 2 packed bytes must fill whole 16-byte vectors
    invalid("the packed values of a row", f"hidden_size = {hidden_size}", "dispatch_dtype 'nvfp4'",
            f"is {hidden_size // 2} bytes", "make hidden_size a multiple of 32",
            dispatch_dtype="nvfp4", hidden_size=hidden_size)


@pytest.mark.parametrize("hidden_size", [32, 96, 4096, 7168])
def test_nvfp4_rows_aligned_pass(hidden_size):
    assert make(dispatch_dtype="nvfp4", hidden_size=hidden_size).dispatch_dtype == "nvfp4"


def test_nvfp4_row_bytes():
    # packed codes, then the block scales padded to 16 bytes: every row stays 16-byte aligned
    assert [nvfp4_row_bytes(h) for h in (32, 128, 256, 4096, 7168)] == [32, 80, 144, 2304, 4032]


@pytest.mark.parametrize("hidden_size", [4, 12, 100, 130])
def test_bf16_rows_need_hidden_multiple_of_8(hidden_size):
    invalid(f"hidden_size = {hidden_size}", "dispatch_dtype 'bf16'", f"is {2 * hidden_size} bytes",
            "multiple of 16 bytes", "make hidden_size a multiple of 8", hidden_size=hidden_size)


@pytest.mark.parametrize("hidden_size", [8, 104, 136])
def test_bf16_rows_aligned_pass(hidden_size):
    assert make(hidden_size=hidden_size, combine_dtype="fp32").hidden_size == hidden_size


def test_fp32_combine_rows_need_hidden_multiple_of_4_reported_first_by_dispatch():
    # With today's dtypes the fp32-combine rule can never fire on its own: dispatch rows are
    # bf16 (H % 8) or fp8 (H % 128), both stricter than H % 4. A bad H is still refused, by
    # the dispatch rule, whose message already tells the fix.
    invalid("hidden_size = 6", "make hidden_size a multiple of 8", hidden_size=6, combine_dtype="fp32")


def test_fp32_combine_rule_message(monkeypatch):
    # Isolate the combine branch: pretend bf16 is 16 bytes wide so dispatch rows always align.
    monkeypatch.setitem(DTYPE_BYTES, "bf16", 16)
    invalid("hidden_size = 6", "combine_dtype 'fp32'", "is 24 bytes", "make hidden_size a multiple of 4",
            hidden_size=6, combine_dtype="fp32")
    assert make(hidden_size=6, combine_dtype="bf16").hidden_size == 6  # 96-byte rows: fine


@pytest.mark.parametrize("alignment", [3, 5, 6, 12, 100])
def test_expert_alignment_power_of_two(alignment):
    invalid(f"expert_alignment = {alignment}", "must be a power of two", expert_alignment=alignment)


@pytest.mark.parametrize("alignment", [1, 2, 4, 64, 128])
def test_expert_alignment_power_of_two_passes(alignment):
    assert make(expert_alignment=alignment).expert_alignment == alignment


POSITIVE = ["hidden_size", "n_experts", "top_k", "max_tokens_per_rank", "intermediate_size", "n_nodes",
            "gpus_per_node", "expert_alignment", "num_sms", "init_timeout_s", "recv_timeout_s",
            "call_timeout_s"]


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize("field", POSITIVE)
def test_sizes_and_timeouts_positive(field, value):
    if field.endswith("_s"):
        value = float(value)
    err = invalid(field, f"input_value={value}", "greater than 0", **{field: value})
    assert [e["loc"] for e in err.errors()] == [(field,)]  # only this field, reported by name


def test_n_shared_experts_non_negative():
    err = invalid("n_shared_experts", "input_value=-1", "greater than or equal to 0", n_shared_experts=-1)
    assert [e["loc"] for e in err.errors()] == [("n_shared_experts",)]
    assert make(n_shared_experts=0).n_shared_experts == 0


def test_receive_side_too_large_for_32bit_offsets():
    # R=1, K=4, L=16: max_recv_rows = N * 4; widest row max(H=128, 2F=128) = 128 elements.
    # rows * 128 < 2^31  <=>  N * 4 < 2^24  <=>  N < 2^22.
    assert make(max_tokens_per_rank=2**22 - 1).max_recv_rows == 4 * (2**22 - 1)
    invalid(f"max_tokens_per_rank = {2**22}", f"({4 * 2**22} rows)", "too large for 32-bit offsets",
            "lower it", max_tokens_per_rank=2**22)


def test_receive_side_limit_counts_intermediate_and_padding():
    N = 2**22 - 1  # fits with F = 64 and no padding (test above)
    # 2F = 256 > H doubles the widest row: now too large
    invalid(f"max_tokens_per_rank = {N}", "lower it", max_tokens_per_rank=N, intermediate_size=128)
    # padding: L * (A - 1) = 16 rows more tips 4N = 2^24 - 4 over 2^24
    invalid(f"max_tokens_per_rank = {N}", f"({4 * N + 16} rows)", max_tokens_per_rank=N, expert_alignment=2)


def test_extra_fields_forbidden():
    err = invalid("num_experts", "Extra inputs are not permitted", num_experts=16)  # a typo of n_experts
    assert [e["loc"] for e in err.errors()] == [("num_experts",)]


def test_frozen():
    cfg = make()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.hidden_size = 256
    assert cfg.hidden_size == 128
    assert hash(cfg) == hash(make())  # frozen models are hashable and compare by value
    assert cfg == make()


@pytest.mark.parametrize("field, value", [("dispatch_dtype", "fp16"), ("combine_dtype", "fp8"), ("backend", "nccl")])
def test_literal_choices(field, value):
    invalid(field, repr(value), **{field: value})


# ---- presets -------------------------------------------------------------------------------
# The sizes PRESETS documents in its comments (model cards), written out independently here.
DOCUMENTED = {
    "deepseek-v3": dict(hidden_size=7168, n_experts=256, top_k=8, intermediate_size=2048, n_shared_experts=1,
                        max_tokens_per_rank=4096, gpus_per_node=4),
    "qwen3-moe": dict(hidden_size=4096, n_experts=128, top_k=8, intermediate_size=1536, n_shared_experts=0,
                      max_tokens_per_rank=4096, gpus_per_node=4),
    "mixtral": dict(hidden_size=4096, n_experts=8, top_k=2, intermediate_size=14336, n_shared_experts=0,
                    max_tokens_per_rank=4096, gpus_per_node=4),
    "tiny": dict(hidden_size=128, n_experts=16, top_k=4, intermediate_size=64, n_shared_experts=0,
                 max_tokens_per_rank=32, gpus_per_node=2),
}


def test_every_preset_is_documented():
    assert set(PRESETS) == set(DOCUMENTED)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_validates_with_documented_sizes(name):
    cfg = EPConfig.preset(name)
    for field, value in DOCUMENTED[name].items():
        assert getattr(cfg, field) == value, field
    assert cfg.n_nodes == 1 and cfg.dispatch_dtype == "bf16" and cfg.combine_dtype == "bf16"


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("gpus_per_node", [1, 2, 4, 8])
def test_preset_on_every_node_size(name, gpus_per_node):
    # every preset's E is divisible by 1, 2, 4 and 8, and fits 32-bit offsets
    cfg = EPConfig.preset(name, gpus_per_node=gpus_per_node)
    assert cfg.world_size == gpus_per_node


def test_preset_overrides():
    before = {k: dict(v) for k, v in PRESETS.items()}
    cfg = EPConfig.preset("deepseek-v3", gpus_per_node=8, n_nodes=2, dispatch_dtype="fp8", max_tokens_per_rank=128)
    assert (cfg.gpus_per_node, cfg.n_nodes, cfg.dispatch_dtype, cfg.max_tokens_per_rank) == (8, 2, "fp8", 128)
    assert (cfg.hidden_size, cfg.n_experts, cfg.top_k) == (7168, 256, 8)  # the rest from the preset
    assert cfg.world_size == 16 and cfg.experts_per_rank == 16
    assert PRESETS == before  # overriding does not edit the table


def test_preset_override_is_validated():
    with pytest.raises(pydantic.ValidationError, match="n_experts"):
        EPConfig.preset("mixtral", gpus_per_node=3)
    with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
        EPConfig.preset("tiny", hidden=256)


def test_unknown_preset_lists_choices():
    with pytest.raises(ValueError) as info:
        EPConfig.preset("deepseek-v4")
    msg = str(info.value)
    assert "'deepseek-v4'" in msg
    for name in PRESETS:
        assert repr(name) in msg
    with pytest.raises(ValueError, match="choose one of"):
        EPConfig.from_dict({"preset": "nope"})


# ---- loading from files --------------------------------------------------------------------
def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_from_yaml(tmp_path):
    path = write(tmp_path, "ep.yaml", "hidden_size: 256\nn_experts: 8\ntop_k: 2\nmax_tokens_per_rank: 64\n"
                                       "gpus_per_node: 2\ndispatch_dtype: fp8\n")
    cfg = EPConfig.from_file(path)
    assert cfg == EPConfig(hidden_size=256, n_experts=8, top_k=2, max_tokens_per_rank=64, gpus_per_node=2,
                           dispatch_dtype="fp8")
    assert EPConfig.from_file(str(path)) == cfg  # str paths work too


def test_from_yaml_under_ep_key(tmp_path):
    path = write(tmp_path, "job.yml", "model: foo\nep:\n  hidden_size: 128\n  n_experts: 16\n  top_k: 4\n"
                                       "  max_tokens_per_rank: 32\n  intermediate_size: 64\n")
    assert EPConfig.from_file(path) == make()


def test_from_yaml_preset_with_overrides(tmp_path):
    path = write(tmp_path, "ep.yaml", "ep:\n  preset: deepseek-v3\n  gpus_per_node: 8\n  max_tokens_per_rank: 256\n")
    cfg = EPConfig.from_file(path)
    assert cfg == EPConfig.preset("deepseek-v3", gpus_per_node=8, max_tokens_per_rank=256)
    # keyword overrides win over the file, which wins over the preset
    cfg = EPConfig.from_file(path, max_tokens_per_rank=8, n_nodes=2)
    assert (cfg.max_tokens_per_rank, cfg.n_nodes, cfg.gpus_per_node, cfg.hidden_size) == (8, 2, 8, 7168)


def test_from_json(tmp_path):
    fields = {**BASE, "gpus_per_node": 4}
    plain = write(tmp_path, "ep.json", json.dumps(fields))
    nested = write(tmp_path, "job.json", json.dumps({"ep": fields, "other": 1}))
    preset = write(tmp_path, "preset.json", json.dumps({"ep": {"preset": "tiny", "gpus_per_node": 8}}))
    assert EPConfig.from_file(plain) == make(gpus_per_node=4)
    assert EPConfig.from_file(nested) == make(gpus_per_node=4)
    assert EPConfig.from_file(preset) == EPConfig.preset("tiny", gpus_per_node=8)
    assert EPConfig.from_file(plain, top_k=1).top_k == 1


def test_file_values_are_validated(tmp_path):
    path = write(tmp_path, "ep.yaml", "preset: tiny\ngpus_per_node: 3\n")
    with pytest.raises(pydantic.ValidationError, match="n_experts"):
        EPConfig.from_file(path)
    path = write(tmp_path, "ep.yaml", "preset: tiny\nhiden_size: 256\n")  # typo
    with pytest.raises(pydantic.ValidationError, match="hiden_size"):
        EPConfig.from_file(path)


@pytest.mark.parametrize("name, text, kind", [
    ("list.yaml", "- 1\n- 2\n", "list"),
    ("scalar.yaml", "42\n", "int"),
    ("text.yml", "just a sentence\n", "str"),
    ("list.json", "[1, 2]", "list"),
    ("scalar.json", "3.5", "float"),
])
def test_non_mapping_file_errors(tmp_path, name, text, kind):
    path = write(tmp_path, name, text)
    with pytest.raises(ValueError) as info:
        EPConfig.from_file(path)
    msg = str(info.value)
    assert str(path) in msg and "expected a mapping" in msg and kind in msg


def test_empty_yaml_reports_missing_fields(tmp_path):
    path = write(tmp_path, "empty.yaml", "")
    with pytest.raises(pydantic.ValidationError, match="hidden_size"):
        EPConfig.from_file(path)


# `ep:` holding a non-mapping (a list, a scalar, or nothing) names the file and the problem
@pytest.mark.parametrize("text", ["ep: [1, 2]\n", "ep: 7\n", "ep:\n"])
def test_non_mapping_under_ep_key_errors(tmp_path, text):
    path = write(tmp_path, "ep.yaml", text)
    with pytest.raises(ValueError, match="expected a mapping"):
        EPConfig.from_file(path)


# ---- derived sizes -------------------------------------------------------------------------
@pytest.mark.parametrize("n_nodes, gpus_per_node, top_k, alignment, expected", [
    # R  L   min(K, L)   max_recv_rows = R * N * min(K, L) + L * (A - 1)   (N = 32)
    (1, 1, 4, 1, (1, 16, 4, 1 * 32 * 4)),
    (1, 2, 4, 1, (2, 8, 4, 2 * 32 * 4)),
    (1, 2, 4, 4, (2, 8, 4, 2 * 32 * 4 + 8 * 3)),
    (2, 4, 4, 8, (8, 2, 2, 8 * 32 * 2 + 2 * 7)),  # K > L: a token meets at most L experts per rank
    (2, 8, 1, 16, (16, 1, 1, 16 * 32 * 1 + 1 * 15)),
    (4, 1, 16, 2, (4, 4, 4, 4 * 32 * 4 + 4 * 1)),
])
def test_derived_sizes(n_nodes, gpus_per_node, top_k, alignment, expected):
    cfg = make(n_nodes=n_nodes, gpus_per_node=gpus_per_node, top_k=top_k, expert_alignment=alignment)
    assert (cfg.world_size, cfg.experts_per_rank, cfg.experts_per_token_rank, cfg.max_recv_rows) == expected


# ---- buffer plan ---------------------------------------------------------------------------
PLAN_CONFIGS = {
    "tiny-1": EPConfig.preset("tiny", gpus_per_node=1),
    "tiny-2": EPConfig.preset("tiny"),
    "tiny-8": EPConfig.preset("tiny", gpus_per_node=4, n_nodes=2),
    "tiny-fp8": EPConfig.preset("tiny", dispatch_dtype="fp8"),
    "tiny-fp8-fp32": EPConfig.preset("tiny", dispatch_dtype="fp8", combine_dtype="fp32", gpus_per_node=4),
    "odd-sizes": make(hidden_size=8, top_k=3, max_tokens_per_rank=5, gpus_per_node=2),  # rows not 128 B
    "deepseek-v3": EPConfig.preset("deepseek-v3"),
    "deepseek-v3-fp8": EPConfig.preset("deepseek-v3", dispatch_dtype="fp8"),
    "tiny-nvfp4": EPConfig.preset("tiny", dispatch_dtype="nvfp4"),
    "deepseek-v3-nvfp4": EPConfig.preset("deepseek-v3", dispatch_dtype="nvfp4", n_nodes=2),
    "mixtral-8": EPConfig.preset("mixtral", gpus_per_node=8),
}
REGIONS = {"dispatch.send", "dispatch.recv", "dispatch.recv_count", "combine.send", "combine.recv",
           "combine.recv_count", "combine.ready"}


def round_up(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


@pytest.mark.parametrize("key", sorted(PLAN_CONFIGS))
def test_plan_layout(key):
    plan = plan_buffers(PLAN_CONFIGS[key])
    assert isinstance(plan, BufferPlan)
    names = [b.name for b in plan.buffers]
    assert len(set(names)) == len(names)
    for b in plan.buffers:
        assert b.nbytes == math.prod(b.shape) * DTYPE_BYTES[b.dtype], b.name
        assert b.offset % ALIGN_BYTES == 0, b.name
    for a, b in zip(plan.buffers, plan.buffers[1:]):
        assert a.offset < b.offset, (a.name, b.name)
        assert a.offset + a.nbytes <= b.offset, f"{a.name} overlaps {b.name}"
    last = plan.buffers[-1]
    assert last.offset + last.nbytes <= plan.total_bytes < last.offset + last.nbytes + ALIGN_BYTES
    assert plan.total_bytes % ALIGN_BYTES == 0
    regions = plan.region_bytes()
    assert set(regions) == REGIONS
    for region, nbytes in regions.items():
        assert nbytes == sum(b.nbytes for b in plan.buffers if b.name.rsplit(".", 1)[0] == region)
    assert sum(regions.values()) <= plan.total_bytes


@pytest.mark.parametrize("key", sorted(PLAN_CONFIGS))
def test_plan_shapes(key):
    cfg = PLAN_CONFIGS[key]
    plan = plan_buffers(cfg)
    R, N, H, K, L = cfg.world_size, cfg.max_tokens_per_rank, cfg.hidden_size, cfg.top_k, cfg.experts_per_rank
    expected = {
        "dispatch.send.x": ((N, H), cfg.dispatch_dtype),
        "dispatch.send.meta": ((N, 3 * K), "int32"),
        "dispatch.send.counts": ((R, L + 1), "int32"),
        "dispatch.recv.x": ((R, N, H), cfg.dispatch_dtype),
        "dispatch.recv.meta": ((R, N, 3 * K), "int32"),
        "dispatch.recv_count.counts": ((2, R, L + 1), "int32"),  # one set per round parity
        "dispatch.recv_count.signal": ((R,), "int64"),
        "combine.send.x": ((R, N, H), cfg.combine_dtype),
        "combine.recv.x": ((R, N, H), cfg.combine_dtype),
        "combine.recv_count.signal": ((R,), "int64"),
        # the epoch each block of partial rows is ready in (pull: blocks of 8 rows)
        "combine.ready.signal": ((R, -(-N // 8) if cfg.combine_mode == "pull" else N), "int64"),
    }
    if cfg.dispatch_dtype == "fp8":  # fp8 adds one fp32 scale per 128 channels, send and recv
        expected["dispatch.send.scales"] = ((N, H // 128), "fp32")
        expected["dispatch.recv.scales"] = ((R, N, H // 128), "fp32")
    if cfg.dispatch_dtype == "nvfp4":  # bytes: packed codes and block scales in one wire row
        expected["dispatch.send.x"] = ((N, nvfp4_row_bytes(H)), "u8")
        expected["dispatch.recv.x"] = ((R, N, nvfp4_row_bytes(H)), "u8")
    assert {b.name: (b.shape, b.dtype) for b in plan.buffers} == expected


def test_fp8_adds_scales():
    bf16, fp8 = plan_buffers(PLAN_CONFIGS["tiny-2"]), plan_buffers(PLAN_CONFIGS["tiny-fp8"])
    assert "dispatch.send.scales" not in bf16 and "dispatch.recv.scales" not in bf16
    assert "dispatch.send.scales" in fp8 and "dispatch.recv.scales" in fp8
    # scales sit in the same regions as their rows
    assert [b.name for b in fp8.buffers][:6] == ["dispatch.send.x", "dispatch.send.scales", "dispatch.send.meta",
                                                  "dispatch.send.counts", "dispatch.recv.x", "dispatch.recv.scales"]
    # fp8 halves the dispatch rows and adds N*H/128*4 (+ R*...) bytes of scales; send also
    # stages the per-destination counts, R rows of L + 1 (L = 16 experts / 2 ranks)
    N, H, R = 32, 128, 2
    assert fp8.region_bytes()["dispatch.send"] == N * H + N * 1 * 4 + N * 12 * 4 + R * 9 * 4
    assert fp8.region_bytes()["dispatch.recv"] == R * N * H + R * N * 1 * 4 + R * N * 12 * 4
    assert bf16.region_bytes()["dispatch.recv"] == R * N * H * 2 + R * N * 12 * 4


def test_nvfp4_rows_carry_their_scales():
    nv = plan_buffers(PLAN_CONFIGS["tiny-nvfp4"])
    assert "dispatch.send.scales" not in nv and "dispatch.recv.scales" not in nv
    # H 128: 64 bytes of codes + 8 scales + 8 padding = 80-byte rows (fp8: 128 + 4, bf16: 256)
    N, R = 32, 2
    assert nv.region_bytes()["dispatch.send"] == N * 80 + N * 12 * 4 + R * 9 * 4
    assert nv.region_bytes()["dispatch.recv"] == R * N * 80 + R * N * 12 * 4
    # the receive rows of DeepSeek-V3: 4032 bytes (0.545x fp8's 7392, 0.28x bf16's 14336)
    assert plan_buffers(PLAN_CONFIGS["deepseek-v3-nvfp4"])["dispatch.recv.x"].shape[-1] == 4032


def test_plan_lookup():
    plan = plan_buffers(PLAN_CONFIGS["tiny-2"])
    spec = plan["dispatch.recv.x"]
    assert (spec.name, spec.shape, spec.dtype) == ("dispatch.recv.x", (2, 32, 128), "bf16")
    assert "combine.recv.x" in plan and "combine.recv" not in plan and "nope" not in plan
    with pytest.raises(KeyError) as info:
        plan["dispatch.recv.scales"]  # exists only with fp8
    msg = info.value.args[0]
    assert "'dispatch.recv.scales'" in msg
    for b in plan.buffers:
        assert b.name in msg  # the message lists what the plan has


@pytest.mark.parametrize("key", ["tiny-2", "tiny-fp8", "deepseek-v3"])
def test_plan_table(key):
    plan = plan_buffers(PLAN_CONFIGS[key])
    table = plan.table()
    for b in plan.buffers:
        assert b.name in table
    assert "total per GPU" in table
    assert f"{plan.total_bytes / 2**20:.2f}" in table.splitlines()[-1]
    assert len(table.splitlines()) == len(plan.buffers) + 2  # header, one row per buffer, total


def test_plan_total_tiny_2_ranks():
    # tiny: R=2, N=32, H=128, K=4, L=8, bf16 rows. Each buffer is rounded up to 128 bytes and
    # laid out in order; the total is the sum of the rounded sizes.
    expected = (
        32 * 128 * 2  # dispatch.send.x        8192
        + 32 * 12 * 4  # dispatch.send.meta    1536
        + 128  # dispatch.send.counts: 2 * 9 * 4 = 72 -> 128
        + 2 * 32 * 128 * 2  # dispatch.recv.x 16384
        + 2 * 32 * 12 * 4  # dispatch.recv.meta 3072
        + 256  # dispatch.recv_count.counts: 2 * 2 * 9 * 4 = 144 -> 256
        + 128  # dispatch.recv_count.signal: 2 * 8 = 16 -> 128
        + 2 * 32 * 128 * 2  # combine.send.x  16384
        + 2 * 32 * 128 * 2  # combine.recv.x  16384
        + 128  # combine.recv_count.signal: 16 -> 128
        + 2 * 32 * 8  # combine.ready.signal: a flag per partial row of each rank, 512
    )
    assert expected == 63104
    assert plan_buffers(EPConfig.preset("tiny")).total_bytes == expected


def test_plan_total_deepseek_v3_4_ranks():
    cfg = EPConfig.preset("deepseek-v3")
    R, N, H, K, L = 4, 4096, 7168, 8, 64
    assert (cfg.world_size, cfg.experts_per_rank) == (R, L)
    expected = sum(round_up(n) for n in [
        N * H * 2,  # dispatch.send.x (bf16)
        N * 3 * K * 4,  # dispatch.send.meta
        R * (L + 1) * 4,  # dispatch.send.counts
        R * N * H * 2,  # dispatch.recv.x
        R * N * 3 * K * 4,  # dispatch.recv.meta
        2 * R * (L + 1) * 4,  # dispatch.recv_count.counts (two round parities)
        R * 8,  # dispatch.recv_count.signal
        R * N * H * 2,  # combine.send.x (bf16)
        R * N * H * 2,  # combine.recv.x
        R * 8,  # combine.recv_count.signal
        R * N * 8,  # combine.ready.signal
    ])
    assert expected == 765_464_064
    total = plan_buffers(cfg).total_bytes
    assert total == expected
    assert 700 * 2**20 < total < 900 * 2**20  # sanity: ~730 MiB per GPU


# ---- memory plan, topology strings, one-line config errors -------------------------------------
def test_memory_plan_from_its_definition():
    cfg = EPConfig.preset("qwen3-moe", gpus_per_node=4, n_shared_experts=1)
    H, Fi, L, E = 4096, 1536, 32, 128
    plan = plan_memory(cfg)
    assert plan.experts_per_layer == (L + 1) * (H * 2 * Fi + Fi * H) * 2  # routed + shared, bf16
    assert plan.scratch == cfg.max_recv_rows * (2 * Fi + Fi + H) * 2  # h [M, 2F], a [M, F], y [M, H]
    assert plan.symmetric == plan_buffers(cfg).total_bytes
    assert plan.check_reference >= (E + 1) * 3 * H * Fi * 2
    assert plan.per_rank(2) == plan.symmetric + plan.scratch + plan.workspace + 2 * plan.experts_per_layer
    # fp8 routed and shared experts: a byte per weight plus a fp32 scale per 128 x 128 block;
    # the SwiGLU output is fp8 with a scale per 128 channels
    f8 = plan_memory(cfg.model_copy(update={"expert_dtype": "fp8"}))
    blocks = (H // 128) * (2 * Fi // 128) + (Fi // 128) * (H // 128)
    assert f8.experts_per_layer == (L + 1) * (3 * H * Fi + 4 * blocks)
    # bf16 dispatch: the receive rows quantised once for the fp8 GEMM, a byte per channel and
    # a fp32 scale per 128 (fp8 dispatch delivers them so)
    rows_fp8 = cfg.world_size * cfg.max_tokens_per_rank * (H + 4 * H // 128)
    assert f8.scratch == cfg.max_recv_rows * ((2 * Fi + H) * 2 + Fi + 4 * Fi // 128) + rows_fp8
    f8_wire = plan_memory(cfg.model_copy(update={"expert_dtype": "fp8", "dispatch_dtype": "fp8"}))
    assert f8_wire.scratch == f8.scratch - rows_fp8


@pytest.mark.parametrize("text, want", [("2x4", (2, 4)), ("1X8", (1, 8))])
def test_parse_topology(text, want):
    assert parse_topology(text) == want


@pytest.mark.parametrize("text", ["2y4", "x4", "0x2", "2x-1", "2x4x1"])
def test_parse_topology_rejects(text):
    with pytest.raises(ValueError, match="topology"):
        parse_topology(text)


def test_config_errors_describe_in_one_line():
    with pytest.raises(pydantic.ValidationError) as info:
        EPConfig(hidden_size=-1, n_experts=8, top_k=0, max_tokens_per_rank=4)
    line = describe_config_error(info.value)
    assert "\n" not in line and "hidden_size: " in line and "top_k: " in line


@pytest.mark.parametrize("field, value", [("hidden_size", True), ("top_k", False), ("num_sms", True),
                                          ("recv_timeout_s", True)])
def test_booleans_are_not_numbers(field, value):
    with pytest.raises(pydantic.ValidationError, match=f"{field} must be a number"):
        EPConfig.preset("tiny", **{field: value})


@pytest.mark.parametrize("value", [math.inf, 1e300, math.nan, 0.0, -1.0])
@pytest.mark.parametrize("field", ["init_timeout_s", "recv_timeout_s", "call_timeout_s"])
def test_timeouts_are_finite_and_bounded(field, value):
    with pytest.raises(pydantic.ValidationError, match=field):
        EPConfig.preset("tiny", **{field: value})


def test_fields_beside_ep_are_an_error(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("ep:\n  preset: tiny\nhidden_size: 256\ncheck:\n  rounds: 1\n")
    with pytest.raises(ValueError, match="hidden_size sit beside 'ep:'"):
        EPConfig.from_file(path)
    path.write_text("ep:\n  preset: tiny\ncheck:\n  rounds: 1\n")  # another tool's section is fine
    assert EPConfig.from_file(path).hidden_size == 128
