"""Small eager forwards replayed from the layer's own CUDA graphs (forward_graphs.py): the same
bits as launching the forward, in the caller's shape, an output a caller holds never
overwritten, a new graph whenever a weight or the config changes, per stream, bounded in number,
never inside an outer capture, a replay that runs none of the layer's other work and a larger
forward that asks the graphs nothing. A layer routing by token id replays with each forward's
ids, wherever they lie, and never without them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.forward_graphs import GRAPHS_PER_KEY, MAX_GRAPHS
from megamoe_torch.layer import MegaMoE

pytestmark = pytest.mark.gpu

FAMILIES = {
    "qwen3": dict(num_experts=32, top_k=4),
    "dsv3_shared": dict(
        num_experts=64,
        top_k=6,
        scoring="sigmoid",
        num_groups=8,
        top_groups=3,
        routed_scaling_factor=2.5,
        use_correction_bias=True,
        num_shared_experts=1,
    ),
    "qwen3_fp8": dict(num_experts=32, top_k=4, weight_dtype="fp8"),
    # DeepSeek-V4's hash layers: each token id's experts from the routing table
    "dsv4_hashed": dict(
        num_experts=32,
        top_k=4,
        scoring="sqrtsoftplus",
        routed_scaling_factor=1.5,
        num_shared_experts=1,
        routing_table_vocab_size=1000,
    ),
}


def _pair(family: str) -> tuple[MegaMoE, MegaMoE]:
    """(a layer that replays graphs, the same layer on the same tensors that always launches)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    config = MegaMoEConfig(
        hidden_size=512, intermediate_size=256, backend="cutedsl", **FAMILIES[family]
    )
    torch.manual_seed(0)
    try:
        replaying = MegaMoE(config, device="cuda", dtype=torch.bfloat16)
    except ValueError as refused:
        pytest.skip(str(refused))
    ok, why = replaying.fused_path_status()
    if not ok:
        pytest.skip(why)
    if replaying.e_score_correction_bias is not None:
        replaying.e_score_correction_bias.normal_(0, 0.05)
    if replaying.routing_table is not None:
        replaying.routing_table.random_(config.num_experts)
    launching = MegaMoE(replace(config, eager_graph_tokens=0), device="meta", dtype=torch.bfloat16)
    launching.load_state_dict(replaying.state_dict(), assign=True)  # the same tensors
    return replaying, launching


def _tokens(tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens, 512, device="cuda", generator=generator).bfloat16()


def _ids(tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(1000, (tokens,), device="cuda", generator=generator)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tokens", [1, 7, 128])
@torch.no_grad()
def test_replayed_forwards_give_the_launched_forwards_bits(family, tokens):
    # every forward passes token ids: the hashed layer routes by them, the others ignore them
    replaying, launching = _pair(family)
    for call in range(4):  # launched, captured, replayed twice (each output dropped)
        x, ids = _tokens(tokens, seed=call), _ids(tokens, seed=call)
        y, logits = replaying(x, input_ids=ids, return_router_logits=True)
        expected, expected_logits = launching(x, input_ids=ids, return_router_logits=True)
        assert torch.equal(y, expected), f"call {call}"
        assert torch.equal(logits, expected_logits), f"call {call}"
        del y, logits
    assert len(replaying._forward_graphs) == 1
    if family != "dsv4_hashed":  # ids or none: the same graph
        assert torch.equal(replaying(x), expected)
        assert len(replaying._forward_graphs) == 1


@torch.no_grad()
def test_a_hashed_replay_reads_the_callers_ids_wherever_they_lie():
    # the graph's second copy node brings the ids in from each forward's ids: the same buffer
    # rewritten, another buffer, a strided view, the caller's [batch, sequence] shape; ids of
    # another dtype are another graph, and a forward without usable ids is refused, never
    # replayed
    replaying, launching = _pair("dsv4_hashed")
    x, ids = _tokens(4, seed=70), _ids(4, seed=70)
    for _ in range(2):  # launched, captured
        replaying(x, input_ids=ids)
    (entry,) = _entries(replaying)
    if entry.copy_source is not None:
        assert entry.ids_copy_source is not None
    ids.copy_(_ids(4, seed=71))  # the same address, new ids
    assert torch.equal(replaying(x, input_ids=ids), launching(x, input_ids=ids))
    other = _ids(4, seed=72)
    assert torch.equal(replaying(x, input_ids=other), launching(x, input_ids=other))
    strided = _ids(8, seed=73)[::2]
    assert not strided.is_contiguous()
    expected = launching(x, input_ids=strided.contiguous())
    assert torch.equal(replaying(x, input_ids=strided), expected)
    assert len(_entries(replaying)) == 1
    for call in range(3):  # another dtype: launched, captured, replayed
        narrow = _ids(4, seed=74 + call).int()
        assert torch.equal(replaying(x, input_ids=narrow), launching(x, input_ids=narrow.long()))
    assert len(_entries(replaying)) == 2
    batched, batched_ids = x.view(2, 2, 512), ids.view(2, 2)
    for _ in range(3):
        y = replaying(batched, input_ids=batched_ids)
        assert y.shape == (2, 2, 512)
        assert torch.equal(y, launching(batched, input_ids=batched_ids))
        del y
    with pytest.raises(TypeError, match="pass input_ids"):
        replaying(x)
    with pytest.raises(ValueError, match="one id per token"):
        replaying(x, input_ids=ids.cpu())
    with pytest.raises(ValueError, match="one id per token"):
        replaying(x, input_ids=ids[:3])


def _graph_outputs(layer: MegaMoE) -> set[int]:
    """The addresses of the static outputs of the layer's graphs."""
    return {
        graph.y.data_ptr() for graphs in layer._forward_graphs._graphs.values() for graph in graphs
    }


@torch.no_grad()
def test_a_dropped_output_is_replayed_and_a_held_one_never_overwritten():
    replaying, launching = _pair("qwen3")
    for call in range(4):  # launched, captured, replayed twice: the graph's own output each time
        x = _tokens(4, seed=call)
        y = replaying(x)
        assert torch.equal(y, launching(x))
        assert (y.data_ptr() in _graph_outputs(replaying)) == (call > 0)
        del y
    assert len(_graph_outputs(replaying)) == 1
    # outputs kept: the second forward captures a second graph of the key, the later ones launch
    held = []
    for call in range(4):
        x = _tokens(4, seed=10 + call)
        held.append((x, replaying(x)))
    outputs = _graph_outputs(replaying)
    assert len(outputs) == GRAPHS_PER_KEY
    assert [y.data_ptr() in outputs for _, y in held] == [True, True, False, False]
    # every output as its forward left it, and still after more forwards
    for call in range(3):
        replaying(_tokens(4, seed=20 + call))
    for x, y in held:
        assert torch.equal(y, launching(x))
    # a view kept is an output kept: the next forward replays the other graph
    first_x, first_output = held[0][0], held[0][1].data_ptr()
    view = held[0][1][1:]
    held.clear()
    x = _tokens(4, seed=30)
    y = replaying(x)
    assert y.data_ptr() in outputs and y.data_ptr() != first_output
    assert torch.equal(y, launching(x))
    assert torch.equal(view, launching(first_x)[1:])


def test_graphs_captured_under_inference_mode_replay_outside_it():
    # the static input and output are normal tensors: a replay under no_grad writes the input in
    # place, and the caller may write the output in place, wherever the graph was captured
    replaying, launching = _pair("qwen3")
    x = _tokens(4, seed=40)
    with torch.inference_mode():
        for _ in range(2):  # launched, captured
            replaying(x)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            y = replaying(x)
            assert y.data_ptr() in _graph_outputs(replaying)
            assert not y.is_inference()
            expected = launching(x)
            assert torch.equal(y, expected)
            y.add_(1)
            del y


def _entries(layer: MegaMoE) -> list:
    return [graph for graphs in layer._forward_graphs._graphs.values() for graph in graphs]


@torch.no_grad()
def test_a_replay_reads_the_callers_tokens_wherever_they_lie():
    # the graph's first node copies the tokens in from the address of each forward's tokens
    # (graph_input.py): the same buffer rewritten, another buffer, a strided view, and a replay
    # pointed elsewhere while the one before is still queued
    replaying, launching = _pair("qwen3")
    x = _tokens(4, seed=50)
    for _ in range(2):  # launched, captured
        replaying(x)
    (entry,) = _entries(replaying)
    assert entry.copy_source is not None
    x.copy_(_tokens(4, seed=51))  # the same address, new tokens
    assert torch.equal(replaying(x), launching(x))
    other = _tokens(4, seed=52)
    assert torch.equal(replaying(other), launching(other))
    strided = _tokens(8, seed=53)[::2]  # a view, not contiguous
    assert not strided.is_contiguous()
    assert torch.equal(replaying(strided), launching(strided.contiguous()))
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    first, second = _tokens(4, seed=54), _tokens(4, seed=55)
    big @ big  # queues the replays behind it
    first_output = replaying(first).clone()  # the graph's output dropped: replayed again next
    second_output = replaying(second)
    assert torch.equal(first_output, launching(first))
    assert torch.equal(second_output, launching(second))
    assert len(_entries(replaying)) == 1


def _without_copy_nodes(monkeypatch, copy_node: str):
    """forward_graphs, its captures copying inputs by torch: the runtime's node updates
    "unavailable", or the copy "not found" as a node (the capture is dropped unreplayed).
    Restored after the test, which turns the nodes off either way."""
    from megamoe_torch import forward_graphs

    monkeypatch.setattr(forward_graphs, "_copies_in_graph", copy_node != "unavailable")
    if copy_node == "not found":
        monkeypatch.setattr(forward_graphs.CopySource, "find", classmethod(lambda *a, **k: None))
    return forward_graphs


@pytest.mark.parametrize("copy_node", ["unavailable", "not found"])
@torch.no_grad()
def test_tokens_copied_by_torch_where_the_graph_cannot_copy_them(monkeypatch, copy_node):
    forward_graphs = _without_copy_nodes(monkeypatch, copy_node)
    replaying, launching = _pair("qwen3")
    for call in range(4):
        x = _tokens(4, seed=60 + call)
        assert torch.equal(replaying(x), launching(x)), f"call {call}"
    # "not found": the capture (second call) launched instead, and turned the graph's copy off
    assert forward_graphs._copies_in_graph is False
    (entry,) = _entries(replaying)
    assert entry.copy_source is None


@torch.no_grad()
def test_a_changed_weight_is_never_replayed_stale():
    replaying, launching = _pair("qwen3")
    x = _tokens(5, seed=1)
    for _ in range(3):
        replaying(x)
    assert len(replaying._forward_graphs) == 1
    replaying.w2.mul_(0.5)  # in place: the prepared weights change with it
    replaying.gate.weight.add_(0.01)
    for _ in range(3):
        assert torch.equal(replaying(x), launching(x))
    replaying.w13 = torch.nn.Parameter(replaying.w13 * 2, requires_grad=False)  # replaced
    launching.w13 = replaying.w13
    for _ in range(3):
        assert torch.equal(replaying(x), launching(x))


@torch.no_grad()
def test_graphs_are_kept_per_stream_and_bounded():
    replaying, launching = _pair("qwen3")
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            for call in range(3):
                x = _tokens(3, seed=call)
                assert torch.equal(replaying(x), launching(x))
    torch.cuda.synchronize()
    assert len(replaying._forward_graphs) == 2
    for tokens in range(1, MAX_GRAPHS + 6):
        x = _tokens(tokens, seed=tokens)
        replaying(x)
        assert torch.equal(replaying(x), launching(x))
    assert len(replaying._forward_graphs) == MAX_GRAPHS


@torch.no_grad()
def test_larger_forwards_and_outer_captures_launch():
    replaying, launching = _pair("qwen3")
    big = _tokens(replaying.config.eager_graph_tokens + 1, seed=2)
    for _ in range(3):
        assert torch.equal(replaying(big), launching(big))
    assert len(replaying._forward_graphs) == 0
    # a caller's own capture records the launches (no graph inside a graph)
    x = _tokens(4, seed=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        replaying(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = replaying(x)
    for seed in range(3):
        x.copy_(_tokens(4, seed=10 + seed))
        graph.replay()
        assert torch.equal(y, launching(x))
    # a capture on a stream whose forwards the layer replays: the lean path steps aside too
    with torch.cuda.stream(side):
        for _ in range(3):
            replaying(x)
    torch.cuda.synchronize()
    assert len(replaying._forward_graphs) == 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        y = replaying(x)
    for seed in range(3):
        x.copy_(_tokens(4, seed=20 + seed))
        graph.replay()
        assert torch.equal(y, launching(x))


@torch.no_grad()
def test_a_larger_forward_asks_the_graphs_nothing(monkeypatch):
    """A forward past eager_graph_tokens launches without a look at the graphs (no key, no
    weights' versions, no capture), though the layer holds graphs of smaller forwards."""
    replaying, launching = _pair("qwen3")
    small = _tokens(2, seed=6)
    for _ in range(3):  # launched, captured, replayed
        replaying(small)
    assert len(replaying._forward_graphs) == 1

    def refused(*args, **kwargs):
        raise AssertionError("a larger forward looked at the graphs")

    monkeypatch.setattr(replaying._forward_graphs, "_key", refused)
    monkeypatch.setattr(replaying._forward_graphs, "forward", refused)
    big = _tokens(replaying.config.eager_graph_tokens + 1, seed=7)
    for _ in range(2):
        assert torch.equal(replaying(big), launching(big))


@torch.no_grad()
def test_a_replay_does_no_other_work_and_keeps_the_callers_shape(monkeypatch):
    replaying, launching = _pair("qwen3")
    x = _tokens(6, seed=4).view(2, 3, 512)
    for _ in range(2):  # launched, captured
        replaying(x)

    def refused(*args, **kwargs):
        raise AssertionError("a replay ran the layer's checks")

    monkeypatch.setattr(replaying, "_check_input", refused)
    monkeypatch.setattr(replaying, "_resolve_backend", refused)
    for seed in range(3):
        x = _tokens(6, seed=30 + seed).view(2, 3, 512)
        y, logits = replaying(x, return_router_logits=True)
        expected, expected_logits = launching(x, return_router_logits=True)
        assert y.shape == (2, 3, 512)
        assert torch.equal(y, expected)
        assert torch.equal(logits, expected_logits)
        del y  # a held output would send the next forward to a second graph


@torch.no_grad()
def test_a_new_config_drops_the_graphs():
    replaying, launching = _pair("qwen3")
    x = _tokens(3, seed=5)
    for _ in range(3):
        replaying(x)
    assert len(replaying._forward_graphs) == 1
    replaying.use_backend("cutedsl")  # another config object: the graphs were captured under
    assert torch.equal(replaying(x), launching(x))
    assert len(replaying._forward_graphs) == 0
    for _ in range(2):
        assert torch.equal(replaying(x), launching(x))
    assert len(replaying._forward_graphs) == 1


def _bucket_pair(family: str) -> tuple[MegaMoE, MegaMoE]:
    """_pair's layers, the replaying one with graphs of one shape up to 4 tokens and bucket
    graphs up to 1024; the launching one puts shared experts in the batch, as a bucket's
    forwards do."""
    replaying, launching = _pair(family)
    config = replace(replaying.config, eager_graph_tokens=4, bucket_graph_tokens=1024)
    bucketed = MegaMoE(config, device="meta", dtype=torch.bfloat16)
    bucketed.load_state_dict(replaying.state_dict(), assign=True)
    if launching.shared_experts is not None:
        path = replace(launching.config, shared_experts_path="batch")
        launching = MegaMoE(path, device="meta", dtype=torch.bfloat16)
        launching.load_state_dict(bucketed.state_dict(), assign=True)
    return bucketed, launching


def _agrees(y: torch.Tensor, expected: torch.Tensor) -> None:
    """A bucket's output against the launched forward's: the same up to the router logits'
    last bits (the GEMM library's algorithm follows the rows), so close in rel-L2, and no more
    than a token in a hundred apart (a near tie of two experts' scores chosen the other way)."""
    assert y.shape == expected.shape and not y.isnan().any()
    difference = (y.float() - expected.float()).reshape(-1, y.shape[-1])
    relative = difference.norm() / expected.float().norm()
    assert relative <= 1e-2, relative
    apart = difference.abs() > 2e-2 + 2e-2 * expected.float().abs().reshape(difference.shape)
    assert apart.any(dim=1).sum() <= max(1, difference.shape[0] // 100)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_a_bucket_graph_replays_any_count_of_its_bucket(family):
    # counts of the buckets 8, 64 and 512 in turns, each a few times: one graph a bucket, each
    # replay the launched forward's output (_agrees), a count's replays the same bits however
    # many tokens the replays between them left in the bucket's rows
    replaying, launching = _bucket_pair(family)
    counts = [6, 50, 300, 7, 33, 257, 6, 50, 300, 5, 64, 512, 50, 300, 6]
    replayed: dict[int, torch.Tensor] = {}  # each count's first replayed output
    for call, tokens in enumerate(counts):
        x, ids = _tokens(tokens, seed=tokens), _ids(tokens, seed=tokens)
        y, logits = replaying(x, input_ids=ids, return_router_logits=True)
        expected, expected_logits = launching(x, input_ids=ids, return_router_logits=True)
        assert logits.shape == expected_logits.shape
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
        _agrees(y, expected)
        if y.data_ptr() in _graph_outputs(replaying):
            if tokens in replayed:
                assert torch.equal(y, replayed[tokens]), f"call {call}: {tokens} tokens"
            else:
                replayed[tokens] = y.clone()
        del y, logits
    assert sorted(replayed) == [5, 6, 7, 33, 50, 64, 257, 300, 512]  # all but the first three
    buckets = {key[0] for key in replaying._forward_graphs._graphs}
    assert buckets == {("bucket", 8, 512), ("bucket", 64, 512), ("bucket", 512, 512)}
    entries = _entries(replaying)
    assert all(entry.bucket is not None for entry in entries)
    for entry in entries:
        if entry.copy_source is not None:  # the count comes in by a node too
            assert entry.count_copy_source is not None


@torch.no_grad()
def test_a_bucket_replay_hands_out_the_first_rows_in_the_callers_shape():
    replaying, launching = _bucket_pair("qwen3")
    x = _tokens(40, seed=80).view(4, 10, 512)
    for _ in range(2):  # launched, captured
        replaying(x)
    (entry,) = _entries(replaying)
    for seed in range(3):
        x = _tokens(36, seed=81 + seed).view(2, 18, 512)  # another count and shape
        y = replaying(x)
        assert y.shape == (2, 18, 512) and y.data_ptr() == entry.y.data_ptr()
        _agrees(y, launching(x))
        held = y  # held: the next forward of the bucket takes a second graph
        other = replaying(_tokens(33, seed=90 + seed))
        assert other.data_ptr() != held.data_ptr()
        del y, held, other
    assert len(_entries(replaying)) == GRAPHS_PER_KEY


@pytest.mark.parametrize("copy_node", ["unavailable", "not found"])
@torch.no_grad()
def test_bucket_inputs_copied_by_torch_where_the_graph_cannot_copy_them(monkeypatch, copy_node):
    forward_graphs = _without_copy_nodes(monkeypatch, copy_node)
    replaying, launching = _bucket_pair("qwen3")
    for call, tokens in enumerate([100, 70, 128, 65, 100]):
        x = _tokens(tokens, seed=100 + call)
        _agrees(replaying(x), launching(x))
    assert forward_graphs._copies_in_graph is False
    (entry,) = _entries(replaying)
    assert entry.copy_source is None and entry.count_copy_source is None
