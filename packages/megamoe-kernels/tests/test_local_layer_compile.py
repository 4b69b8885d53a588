"""Compile-only: the single-GPU routing/dispatch and combine kernels compile for sm_90a on a CPU
for every routing family and row width they serve, and refuse what they cannot serve."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels.shim.local_layer import CombineLauncher, RouteLauncher, routing_problems

pytestmark = pytest.mark.compile

ROUTERS = [
    dict(num_experts=128, top_k=8, hidden_size=2048),  # qwen3: softmax, 8 vectors per lane
    dict(num_experts=8, top_k=2, hidden_size=4096, logits_dtype=torch.bfloat16),  # mixtral
    dict(num_experts=40, top_k=6, hidden_size=2880, renormalize=False),  # unroll 1, E % 32 != 0
    dict(  # dsv3: sigmoid, grouped top-k, bias, scaling
        num_experts=256,
        top_k=8,
        hidden_size=7168,
        scoring="sigmoid",
        num_groups=8,
        top_groups=4,
        routed_scaling_factor=2.5,
        has_correction_bias=True,
    ),
    dict(num_experts=512, top_k=32, hidden_size=8, scoring="sigmoid", dropped_group_score=0.0),
    # softmax with a correction bias (ERNIE 4.5); group-limited greedy, groups by their best
    # expert (DeepSeek-V2); softmax in groups by their two best; the choice on logits + bias
    dict(num_experts=64, top_k=6, hidden_size=2560, has_correction_bias=True),
    dict(
        num_experts=160,
        top_k=6,
        hidden_size=5120,
        num_groups=8,
        top_groups=3,
        group_score="max",
        routed_scaling_factor=16.0,
        renormalize=False,
    ),
    dict(num_experts=64, top_k=4, hidden_size=2048, num_groups=8, top_groups=2),
    # PhiMoE's sparsemixer; DeepSeek-V4's sqrt(softplus) scores chosen with a bias
    dict(num_experts=16, top_k=2, hidden_size=4096, scoring="sparsemixer", renormalize=False),
    dict(
        num_experts=256,
        top_k=6,
        hidden_size=4096,
        scoring="sqrtsoftplus",
        routed_scaling_factor=1.5,
        has_correction_bias=True,
    ),
    dict(
        num_experts=40,
        top_k=4,
        hidden_size=2048,
        scoring="sigmoid",
        has_correction_bias=True,
        choice_on_logits=True,
        num_groups=4,
        top_groups=2,
        group_score="max",
        dropped_group_score=0.0,
    ),
]
# FP8 rows: quantized as the tokens are copied (qwen3; dsv3's 7168 = 56 groups of 128; a
# partial last group)
FP8_ROUTERS = [
    dict(ROUTERS[0], rows_dtype=torch.float8_e4m3fn),
    dict(ROUTERS[3], rows_dtype=torch.float8_e4m3fn),
    dict(ROUTERS[3], rows_dtype=torch.float8_e4m3fn, unroll=1),  # one load in flight
    dict(num_experts=40, top_k=6, hidden_size=2880, rows_dtype=torch.float8_e4m3fn),
]


@pytest.mark.parametrize("constants", ROUTERS, ids=lambda c: f"E{c['num_experts']}-K{c['top_k']}")
def test_route_and_place_and_the_routing_alone_compile(constants):
    launcher = RouteLauncher(**constants, compile_only=True)
    assert launcher.compile() is not None
    assert launcher.compile(route_only=True) is not None


@pytest.mark.parametrize(
    "constants",
    FP8_ROUTERS,
    ids=lambda c: f"E{c['num_experts']}-H{c['hidden_size']}-U{c.get('unroll', 'auto')}",
)
def test_route_and_place_quantizing_to_fp8_rows_compiles(constants):
    launcher = RouteLauncher(**constants, compile_only=True)
    assert launcher.scale_groups == -(-constants["hidden_size"] // 128)
    assert launcher.compile() is not None


# shared experts in the batch: dsv3's one (copied rows, FP8 rows, gathered rows), a shared MLP
# of four routed sizes with its sigmoid gate (Qwen2-MoE), the most pairs a warp holds
SHARED_ROUTERS = [
    dict(ROUTERS[3], shared_experts=1),
    dict(ROUTERS[3], shared_experts=1, rows_dtype=torch.float8_e4m3fn),
    dict(ROUTERS[3], shared_experts=1, gather_rows=True),
    dict(num_experts=60, top_k=4, hidden_size=2048, shared_experts=4, shared_expert_gate=True),
    dict(num_experts=64, top_k=24, hidden_size=512, shared_experts=8, copy_by_token=False),
]


@pytest.mark.parametrize(
    "constants",
    SHARED_ROUTERS,
    ids=lambda c: f"E{c['num_experts']}-K{c['top_k']}-S{c['shared_experts']}",
)
def test_route_and_place_with_shared_experts_compiles(constants):
    launcher = RouteLauncher(**constants, compile_only=True)
    assert launcher.pairs == constants["top_k"] + constants["shared_experts"]
    assert launcher.compile() is not None


# rows scaled by their routing weight as they are copied (Llama 4: sigmoid top-1 with its
# shared expert in the batch; top-2 by pair, not by token; a width of one vector per lane)
WEIGHTS_ON_INPUT_ROUTERS = [
    dict(
        num_experts=16,
        top_k=1,
        hidden_size=5120,
        scoring="sigmoid",
        renormalize=False,
        shared_experts=1,
    ),
    dict(
        num_experts=128,
        top_k=2,
        hidden_size=5120,
        scoring="sigmoid",
        renormalize=False,
        copy_by_token=False,
    ),
    dict(num_experts=8, top_k=2, hidden_size=256, logits_dtype=torch.bfloat16),
]


@pytest.mark.parametrize(
    "constants",
    WEIGHTS_ON_INPUT_ROUTERS,
    ids=lambda c: f"E{c['num_experts']}-K{c['top_k']}-H{c['hidden_size']}",
)
def test_route_and_place_scaling_rows_by_their_weights_compiles(constants):
    launcher = RouteLauncher(**constants, weights_on_input=True, compile_only=True)
    plain = RouteLauncher(**constants, compile_only=True)
    assert launcher.compile() is not None
    assert launcher.compile() is not plain.compile()  # its own compiled variant


@pytest.mark.parametrize(
    "constants",
    [
        # a model's own top-k (transformers' experts interface): int64 ids, weights as given
        dict(ROUTERS[0], given_ids_dtype=torch.int64, given_weights_dtype=torch.float32),
        dict(ROUTERS[1], given_ids_dtype=torch.int64, given_weights_dtype=torch.bfloat16),
        dict(
            ROUTERS[0],
            gather_rows=True,
            given_ids_dtype=torch.int32,
            given_weights_dtype=torch.float32,
        ),
        dict(FP8_ROUTERS[0], given_ids_dtype=torch.int64, given_weights_dtype=torch.float32),
        # DeepSeek-V4's hash layers: the table's experts weighted by their scores, shared
        # experts in the batch, a bias the given experts do without
        dict(ROUTERS[9], given_ids_dtype=torch.int64, shared_experts=1),
        dict(ROUTERS[3], given_ids_dtype=torch.int32),  # grouped scoring: the groups unused
    ],
    ids=["qwen3", "mixtral-bf16-weights", "qwen3-gathered", "qwen3-fp8", "v4-hash", "dsv3"],
)
def test_route_and_place_of_given_experts_compiles(constants):
    launcher = RouteLauncher(**constants, compile_only=True)
    plain = RouteLauncher(
        **{k: v for k, v in constants.items() if not k.startswith("given")}, compile_only=True
    )
    assert launcher.compile() is not None
    assert launcher.compile() is not plain.compile()  # its own compiled variant
    # the call takes exactly the tensors the launcher was built for
    tokens, hidden, top_k = 2, constants["hidden_size"], constants["top_k"]
    x_TH = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    logits_TE = None
    if "given_weights_dtype" not in constants:  # weighted by the experts' scores
        logits_TE = torch.empty(tokens, constants["num_experts"])
    with pytest.raises(ValueError, match="topk_ids_TK is required by this launcher"):
        launcher(logits_TE, x_TH, capacity=tokens * top_k)


@pytest.mark.parametrize(
    ("constants", "message"),
    [
        (dict(given_ids_dtype=torch.float32), "given_ids_dtype=torch.float32 is not None"),
        (dict(given_weights_dtype=torch.float32), "given weights come with given ids"),
        (
            dict(given_ids_dtype=torch.int64, given_weights_dtype=torch.float16),
            "given_weights_dtype=torch.float16",
        ),
        (
            dict(scoring="sparsemixer", renormalize=False, given_ids_dtype=torch.int64),
            "scoring='sparsemixer' has none",
        ),
    ],
)
def test_given_experts_that_cannot_be_placed_are_refused(constants, message):
    with pytest.raises(ValueError, match="the routing kernel cannot serve") as refusal:
        RouteLauncher(num_experts=16, top_k=2, hidden_size=256, compile_only=True, **constants)
    assert message in str(refusal.value)


@pytest.mark.parametrize(
    ("constants", "message"),
    [
        (dict(rows_dtype=torch.float8_e4m3fn), "rows_dtype=torch.float8_e4m3fn"),
        (dict(gather_rows=True), "gather_rows=True"),
    ],
)
def test_scaled_rows_are_refused_where_no_bf16_row_is_copied(constants, message):
    with pytest.raises(ValueError, match="weights_on_input=True") as refusal:
        RouteLauncher(
            num_experts=8,
            top_k=2,
            hidden_size=256,
            weights_on_input=True,
            compile_only=True,
            **constants,
        )
    assert message in str(refusal.value)


@pytest.mark.parametrize(
    ("experts", "top_k", "hidden", "cta_tokens", "one_cta"),
    [
        # one CTA up to two passes of its warps, and at most the bf16 bytes' rule
        (128, 8, 2048, 4, 8),  # qwen3: 4 slices a row (unroll 2)
        (32, 1, 7168, 2, 4),  # dsv3 on an 8-way EP rank: 7 slices (unroll 4)
        (8, 2, 4096, 4, 8),  # mixtral: 4 slices; 8 experts would fit one CTA up to 16 tokens
        (40, 6, 2880, 1, 2),  # 12 slices of 32 vectors (unroll 1), the last partial
    ],
)
def test_quantizing_copies_take_a_pass_of_slices_per_cta(
    experts, top_k, hidden, cta_tokens, one_cta
):
    quantizing = RouteLauncher(
        num_experts=experts,
        top_k=top_k,
        hidden_size=hidden,
        rows_dtype=torch.float8_e4m3fn,
        compile_only=True,
    )
    assert quantizing.cta_tokens == cta_tokens
    assert quantizing._one_cta_token_limit == one_cta
    copying = RouteLauncher(num_experts=experts, top_k=top_k, hidden_size=hidden, compile_only=True)
    assert copying.cta_tokens == 16  # a warp per token
    with pytest.raises(ValueError, match="cta_tokens=0 must lie in"):
        RouteLauncher(num_experts=experts, top_k=top_k, hidden_size=hidden, cta_tokens=0)


@pytest.mark.parametrize(
    "constants",
    [ROUTERS[0], ROUTERS[3], dict(ROUTERS[0], gather_rows=True), FP8_ROUTERS[0]],
    ids=["qwen3", "dsv3", "qwen3-gathered", "qwen3-fp8"],
)
def test_route_and_place_publishing_its_offsets_compiles(constants):
    launcher = RouteLauncher(**constants, publish_offsets=True, compile_only=True)
    assert launcher.publishes_offsets
    assert launcher.compile() is not None
    # the offsets it hands out are followed in their storage by the word it publishes them in
    x_TH = torch.empty(3, constants["hidden_size"], dtype=torch.bfloat16)
    offsets = launcher._new_outputs(3, 3 * constants["top_k"], x_TH)[3]
    experts = constants["num_experts"]
    assert offsets.shape == (experts + 1,)
    assert offsets.untyped_storage().nbytes() == (experts + 2) * 4


def test_offsets_are_published_for_the_calls_the_knob_names(monkeypatch):
    from megamoe_kernels.shim import knobs
    from megamoe_kernels.shim.local_layer import route_launcher

    # one token by default: where polling measured faster (knobs.GATE_UP_POLLS_OFFSETS_MAX_TOKENS)
    assert knobs.routing_publishes_offsets(0) and knobs.routing_publishes_offsets(1)
    assert not knobs.routing_publishes_offsets(2)
    monkeypatch.setattr(knobs, "GATE_UP_POLLS_OFFSETS_MAX_TOKENS", 0)
    assert not knobs.routing_publishes_offsets(1)
    # a launcher publishes where it is built to, the kept ones keyed on it
    assert not RouteLauncher(**ROUTERS[0], compile_only=True).publishes_offsets
    assert not route_launcher(**ROUTERS[0], compile_only=True).publishes_offsets
    assert route_launcher(**ROUTERS[0], publish_offsets=True, compile_only=True).publishes_offsets
    x_TH = torch.empty(1, ROUTERS[0]["hidden_size"], dtype=torch.bfloat16)
    plain = RouteLauncher(**ROUTERS[0], compile_only=True)
    assert plain._new_outputs(1, 8, x_TH)[3].untyped_storage().nbytes() == 129 * 4


@pytest.mark.parametrize(
    "constants",
    [
        dict(top_k=8, hidden_size=2048),
        dict(top_k=2, hidden_size=4096, weighted=False),
        dict(top_k=8, hidden_size=7168, has_addend=True),
    ],
)
def test_combine_compiles(constants):
    launcher = CombineLauncher(**constants, compile_only=True)
    assert launcher.compile() is not None
    # the variant that takes a token count from the device (a graph of a bucket of tokens)
    assert launcher.compile(counted=True) not in (None, launcher.compile())


@pytest.mark.parametrize(
    "constants",
    [ROUTERS[0], ROUTERS[3], FP8_ROUTERS[1], dict(ROUTERS[0], gather_rows=True)],
    ids=["qwen3", "dsv3", "dsv3-fp8", "qwen3-gathered"],
)
def test_route_and_place_taking_a_token_count_compiles(constants):
    launcher = RouteLauncher(**constants, compile_only=True)
    counted = launcher.compile(counted=True)
    assert counted not in (None, launcher.compile())  # its own compiled variant


@pytest.mark.parametrize(
    "token_count",
    [
        torch.zeros(1, dtype=torch.int64),  # not int32
        torch.zeros(2, dtype=torch.int32),  # not one word
        torch.zeros((), dtype=torch.int32, device="meta"),  # another device
    ],
    ids=["int64", "two-words", "meta"],
)
def test_a_token_count_that_is_not_one_int32_word_of_the_device_is_refused(token_count):
    expert_out_MH = torch.empty(8, 1024, dtype=torch.bfloat16)
    row_of_pair_TK = torch.zeros(4, 2, dtype=torch.int32)
    launcher = CombineLauncher(top_k=2, hidden_size=1024, compile_only=True)
    with pytest.raises(ValueError, match="token_count: one int32 word on cpu expected"):
        launcher(expert_out_MH, row_of_pair_TK, torch.ones(4, 2), token_count=token_count)
    router = RouteLauncher(num_experts=8, top_k=2, hidden_size=1024, compile_only=True)
    x_TH = torch.empty(4, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="token_count: one int32 word on cpu expected"):
        router(torch.zeros(4, 8), x_TH, capacity=8, token_count=token_count)


@pytest.mark.parametrize(
    "out",
    [
        torch.empty(3, 1024, dtype=torch.bfloat16),  # rows for another token count
        torch.empty(4, 512, dtype=torch.bfloat16),  # another hidden size
        torch.empty(4, 1024, dtype=torch.float32),  # another dtype
        torch.empty(1024, 4, dtype=torch.bfloat16).t(),  # not row-major
    ],
)
def test_the_combine_refuses_an_output_it_cannot_write(out):
    launcher = CombineLauncher(top_k=2, hidden_size=1024, compile_only=True)
    expert_out_MH = torch.empty(8, 1024, dtype=torch.bfloat16)
    row_of_pair_TK = torch.zeros(4, 2, dtype=torch.int32)
    weights_TK = torch.ones(4, 2)
    with pytest.raises(ValueError, match=r"out: a contiguous \[4, 1024\] torch.bfloat16"):
        launcher(expert_out_MH, row_of_pair_TK, weights_TK, out_TH=out)


@pytest.mark.parametrize(
    ("hidden_size", "rows_dtype", "unroll", "split_tokens"),
    [
        (2048, torch.bfloat16, 8, 0),  # qwen3: a row is one slice, nothing to share
        (7168, torch.bfloat16, 4, 16),  # dsv3: 7 slices
        (2880, torch.bfloat16, 1, 16),  # gpt-oss: 11 slices and a part
        (2048, torch.float8_e4m3fn, 2, 16),  # quantized rows keep 4 slices or more
        (4096, torch.float8_e4m3fn, 4, 16),
        (7168, torch.float8_e4m3fn, 4, 16),
        (2880, torch.float8_e4m3fn, 1, 16),
        (256, torch.float8_e4m3fn, 1, 0),  # one slice at unroll 1
    ],
)
def test_the_default_copy_knobs_follow_the_measured_rule(
    hidden_size, rows_dtype, unroll, split_tokens
):
    launcher = RouteLauncher(
        num_experts=8, top_k=2, hidden_size=hidden_size, rows_dtype=rows_dtype, compile_only=True
    )
    assert (launcher.unroll, launcher.split_tokens) == (unroll, split_tokens)


def test_what_the_kernels_cannot_serve_is_refused_with_the_reason():
    assert routing_problems(num_experts=128, top_k=8, hidden_size=2048) == []
    assert "top_k=33" in routing_problems(num_experts=128, top_k=33, hidden_size=2048)[0]
    assert "num_experts=1024" in routing_problems(num_experts=1024, top_k=8, hidden_size=2048)[0]
    assert "multiple of 8" in routing_problems(num_experts=8, top_k=2, hidden_size=100)[0]
    assert (
        "with 8 shared experts"
        in routing_problems(num_experts=128, top_k=25, hidden_size=2048, shared_experts=8)[0]
    )
    assert (
        "with 1 shared experts"
        in routing_problems(num_experts=512, top_k=8, hidden_size=2048, shared_experts=1)[0]
    )
    with pytest.raises(ValueError, match="scoring='sparsemixer' chooses two experts"):
        RouteLauncher(
            num_experts=8, top_k=3, hidden_size=64, scoring="sparsemixer", compile_only=True
        )
    with pytest.raises(ValueError, match=r"group_score='min' is not one of \('top2_sum', 'max'\)"):
        RouteLauncher(
            num_experts=8,
            top_k=2,
            hidden_size=64,
            num_groups=4,
            group_score="min",
            compile_only=True,
        )
    for unroll in (3, 16):
        with pytest.raises(ValueError, match=f"unroll={unroll} must be 1, 2, 4 or 8"):
            RouteLauncher(num_experts=8, top_k=2, hidden_size=2048, unroll=unroll)
    # dsv3's 896 vectors: 256 do not divide them
    with pytest.raises(ValueError, match="the largest here: 4"):
        RouteLauncher(num_experts=8, top_k=2, hidden_size=7168, unroll=8)
    with pytest.raises(ValueError, match="quantized by token"):
        RouteLauncher(
            num_experts=8,
            top_k=2,
            hidden_size=64,
            rows_dtype=torch.float8_e4m3fn,
            copy_by_token=False,
            compile_only=True,
        )
    with pytest.raises(ValueError, match="logits dtype"):
        RouteLauncher(
            num_experts=8, top_k=2, hidden_size=64, logits_dtype=torch.float16, compile_only=True
        )


def test_a_shared_gate_needs_shared_experts():
    with pytest.raises(ValueError, match="shared_expert_gate=True gates shared experts"):
        RouteLauncher(**ROUTERS[0], shared_expert_gate=True, compile_only=True)


# (kernel, constants): the combine at top_k 1, 2, 8 (with an addend) and 32; the routing kernel
# with up to 128 experts and bf16 rows, copied, gathered or scaled (two CTAs per SM), and with
# more experts or quantized rows (one)
RESIDENT_VARIANTS = [
    ("combine", dict(top_k=1, hidden_size=7168)),
    ("combine", dict(top_k=2, hidden_size=4096, weighted=False)),
    ("combine", dict(top_k=8, hidden_size=7168, has_addend=True)),
    ("combine", dict(top_k=32, hidden_size=2048)),
    ("route", ROUTERS[0]),
    ("route", ROUTERS[1]),
    ("route", dict(ROUTERS[0], gather_rows=True)),
    ("route", dict(num_experts=16, top_k=1, hidden_size=5120, weights_on_input=True)),
    ("route", dict(ROUTERS[0], shared_experts=4, shared_expert_gate=True)),
    ("route", ROUTERS[3]),
    ("route", ROUTERS[4]),
    ("route", FP8_ROUTERS[0]),
]

# compiles each of RESIDENT_VARIANTS in turn (in a process of its own: CuTe DSL reads its dump
# settings once per process) and prints its cubin's registers, stack and local memory
_PRINT_RESOURCES = """
import pathlib, re, subprocess, sys
sys.path.insert(0, sys.argv[2])
from megamoe_kernels.sass_check import disassembler_bin_dir
from megamoe_kernels.shim.local_layer import CombineLauncher, RouteLauncher
from test_local_layer_compile import RESIDENT_VARIANTS

dump, cuobjdump = pathlib.Path(sys.argv[1]), disassembler_bin_dir() / "cuobjdump"
for kind, constants in RESIDENT_VARIANTS:
    for old in dump.rglob("*.cubin"):
        old.unlink()
    if kind == "route":
        RouteLauncher(**constants, compile_only=True).compile()
    else:
        CombineLauncher(**constants, compile_only=True)
    (cubin,) = dump.rglob("*.cubin")
    usage = subprocess.run(
        [str(cuobjdump), "--dump-resource-usage", str(cubin)],
        capture_output=True,
        text=True,
    ).stdout
    print(re.search(r"REG:\\d+ STACK:\\d+ SHARED:\\d+ LOCAL:\\d+", usage).group(0))
"""


def test_launch_bounds_keep_every_ctas_per_sm_resident_without_spills(tmp_path):
    """The combine's grid is one wave, and the routing kernel's grid barriers need all of its
    CTAs resident: each variant's registers must let the CTAs per SM its launch bounds name
    (combine_residency, route_residency) share an SM's 64K registers (allocated per warp, 8 a
    thread at a time), with no spills."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from megamoe_kernels.sass_check import disassembler_bin_dir
    from megamoe_kernels.shim.local_layer import combine_residency, route_residency

    if disassembler_bin_dir() is None:
        pytest.skip("needs cuobjdump and nvdisasm")
    env = dict(os.environ, CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(tmp_path))
    env.setdefault("CUTE_DSL_ARCH", "sm_90a")
    result = subprocess.run(
        [sys.executable, "-c", _PRINT_RESOURCES, str(tmp_path), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().split("\n")
    for (kind, constants), line in zip(RESIDENT_VARIANTS, lines, strict=True):
        registers, stack, _, local = (int(field.split(":")[1]) for field in line.split())
        if kind == "combine":
            threads, ctas = combine_residency(constants["top_k"])
        else:
            experts = constants["num_experts"] + constants.get("shared_experts", 0)
            quantizes = constants.get("rows_dtype") == torch.float8_e4m3fn
            threads, ctas = route_residency(experts, quantizes)
        allocated = -(-registers // 8) * 8 * threads * ctas
        assert allocated <= 65536 and stack == local == 0, (kind, constants, line)


# row tokens for the atomic combine: copied bf16 rows, FP8 rows, gathered rows, shared experts
ROW_TOKEN_ROUTERS = [
    dict(ROUTERS[0], row_tokens=True),
    dict(ROUTERS[3], row_tokens=True, rows_dtype=torch.float8_e4m3fn),
    dict(ROUTERS[0], row_tokens=True, gather_rows=True),
    dict(ROUTERS[3], row_tokens=True, shared_experts=1),
]


@pytest.mark.parametrize(
    "constants", ROW_TOKEN_ROUTERS, ids=lambda c: f"E{c['num_experts']}-{c.get('rows_dtype')}"
)
def test_route_and_place_writing_row_tokens_compiles(constants):
    launcher = RouteLauncher(**constants, compile_only=True)
    assert launcher.row_tokens
    assert launcher.compile() is not None
