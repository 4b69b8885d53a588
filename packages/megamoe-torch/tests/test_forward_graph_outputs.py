"""When a replayed forward's static output is free to be written again (forward_graphs.py): only
while no tensor of a caller, a view included, shares its storage; and the graphs a key takes
while outputs are held, and the token ids a key takes. CPU: the rule is the storage's use
count, and the captures are stood in for, so neither needs a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from megamoe_torch.forward_graphs import GRAPHS_PER_KEY, ForwardGraphs, _free_graph, _Graph


def _graph() -> _Graph:
    return _Graph(
        graph=None, x=torch.empty(2, 8), y=torch.empty(2, 8), router_logits_TE=torch.empty(2, 4)
    )


def test_an_output_is_free_only_while_no_caller_holds_a_tensor_of_it():
    graph = _graph()
    assert graph.output_free()
    handed_out = graph.y.view(graph.y.shape)  # what a replay returns
    assert not graph.output_free()
    row = handed_out[1]
    del handed_out
    assert not graph.output_free()  # a view of it still shares the storage
    del row
    assert graph.output_free()
    detached = graph.y.detach()
    assert not graph.output_free()
    del detached
    # a copy shares nothing
    copy = graph.y.clone()
    assert graph.output_free()
    del copy


def test_the_first_free_graph_is_taken():
    first, second = _graph(), _graph()
    assert _free_graph([first, second]) is first
    held = first.y.view(-1)
    assert _free_graph([first, second]) is second
    held_too = second.y[0]
    assert _free_graph([first, second]) is None
    del held
    assert _free_graph([first, second]) is first
    del held_too
    assert _free_graph([]) is None


class _Replays:
    """A stand-in for a captured CUDA graph: counts its replays."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


class _Layer(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=hidden)
        self.weight = torch.nn.Parameter(torch.zeros(hidden))


def test_a_key_takes_a_second_graph_while_the_first_output_is_held(monkeypatch):
    # ForwardGraphs' policy with its captures stood in for (CPU tensors, stream 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    captured = []

    def capture(self, layer, x, input_ids, device_index, stream):
        graph = _Graph(
            graph=_Replays(),
            x=torch.empty_like(x),
            y=torch.empty_like(x),
            router_logits_TE=torch.empty(x.shape[0], 4),
            ids=None if input_ids is None else input_ids.new_empty(input_ids.numel()),
        )
        captured.append(graph)
        return graph

    monkeypatch.setattr(ForwardGraphs, "_capture", capture)
    graphs, layer = ForwardGraphs(max_tokens=8), _Layer(16)
    x = torch.randn(2, 16)
    assert graphs.forward(layer, x) is None  # the first forward of a key runs eagerly
    first, _ = graphs.forward(layer, x)  # the second captures and runs the graph
    assert len(captured) == 1 and first.data_ptr() == captured[0].y.data_ptr()
    assert torch.equal(captured[0].x, x)
    second, _ = graphs.forward(layer, x)  # the first output held: a second graph
    assert len(captured) == GRAPHS_PER_KEY and second.data_ptr() == captured[1].y.data_ptr()
    assert graphs.forward(layer, x) is None  # both held: launch
    del first
    again, logits = graphs.forward(layer, x, router_logits=True)  # the first graph again
    assert again.data_ptr() == captured[0].y.data_ptr()
    assert logits.data_ptr() != captured[0].router_logits_TE.data_ptr()  # a copy
    assert [graph.graph.replays for graph in captured] == [2, 1]
    assert len(graphs) == 1  # one key
    del second, again
    # a layer routing by token id: its ids are part of the key, brought in before each replay
    ids = torch.tensor([[3, 5]])
    assert graphs.forward(layer, x, input_ids=ids) is None  # another key: launched
    graphs.forward(layer, x, input_ids=ids)  # captured and replayed
    graphs.forward(layer, x, input_ids=torch.tensor([[7, 1]]))
    assert len(graphs) == 2 and captured[-1].graph.replays == 2
    assert torch.equal(captured[-1].ids, torch.tensor([7, 1]))
    assert graphs.forward(layer, x, input_ids=ids.int()) is None  # another dtype: another key


def test_longer_forwards_take_the_graph_of_their_bucket():
    graphs = ForwardGraphs(max_tokens=128, max_bucket_tokens=6000)
    assert graphs.takes(128) and graphs.takes(6000) and not graphs.takes(6001)
    assert not graphs.takes(0)
    assert [graphs.bucket_of(t) for t in (1, 128, 129, 256, 257, 4096, 4097, 6000)] == [
        None,
        None,
        256,
        256,
        512,
        4096,
        6000,  # the next power of two, at most max_bucket_tokens
        6000,
    ]
    # no buckets: the graphs of one shape alone
    assert not ForwardGraphs(max_tokens=128).takes(129)
    assert not ForwardGraphs(max_tokens=128, max_bucket_tokens=64).takes(129)


def test_a_bucket_graph_replays_every_count_of_its_bucket(monkeypatch):
    # ForwardGraphs' bucket policy with its captures stood in for (CPU tensors, stream 0, the
    # inputs brought in by torch): one graph serves every count of a bucket and every shape of
    # those tokens, writing their rows and count; each replay hands out the first rows of y
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    captured = []

    def capture(self, layer, x, input_ids, device_index, stream):
        bucket = self.bucket_of(x.numel() // layer.config.hidden_size)
        graph = _Graph(
            graph=_Replays(),
            x=torch.zeros(bucket, x.shape[-1]),
            y=torch.randn(bucket, x.shape[-1]),
            router_logits_TE=torch.randn(bucket, 4),
            ids=None if input_ids is None else input_ids.new_zeros(bucket),
            bucket=bucket,
            token_count=torch.empty(1, dtype=torch.int32),
            counts=torch.arange(bucket + 1, dtype=torch.int32),
        )
        captured.append(graph)
        return graph

    monkeypatch.setattr(ForwardGraphs, "_capture", capture)
    graphs, layer = ForwardGraphs(max_tokens=4, max_bucket_tokens=16), _Layer(8)
    x = torch.randn(6, 8)
    assert graphs.forward(layer, x) is None  # the first forward of the bucket runs eagerly
    y, logits = graphs.forward(layer, x, router_logits=True)
    assert len(captured) == 1 and captured[0].bucket == 8
    assert y.shape == x.shape and y.data_ptr() == captured[0].y.data_ptr()
    assert torch.equal(logits, captured[0].router_logits_TE[:6])
    assert torch.equal(captured[0].x[:6], x) and captured[0].token_count.item() == 6
    del y
    # another count and shape of the same bucket: the same graph
    x_batched = torch.randn(1, 7, 8)
    y, _ = graphs.forward(layer, x_batched)
    assert len(captured) == 1 and y.shape == (1, 7, 8)
    assert torch.equal(captured[0].x[:7], x_batched[0]) and captured[0].token_count.item() == 7
    # the only graph's output held: a second graph of the bucket
    x_five = torch.randn(5, 8)
    held, _ = graphs.forward(layer, x_five)
    assert len(captured) == GRAPHS_PER_KEY and captured[1].token_count.item() == 5
    del y, held
    # the first again, for the bucket's largest count
    x_eight = torch.randn(8, 8)
    y, _ = graphs.forward(layer, x_eight)
    assert torch.equal(captured[0].x, x_eight) and captured[0].token_count.item() == 8
    assert [graph.graph.replays for graph in captured] == [3, 1]
    del y
    # another bucket, and rows of another width (as many values): other keys
    assert graphs.forward(layer, torch.randn(9, 8)) is None
    assert graphs.forward(layer, torch.randn(12, 4)) is None
    assert len(graphs) == 1
    # ids route a layer by token id: one a token, any shape
    ids = torch.tensor([[3, 5, 1, 2, 0, 4]])
    assert graphs.forward(layer, x, input_ids=ids) is None
    graphs.forward(layer, x, input_ids=ids)
    assert torch.equal(captured[-1].ids[:6], ids.view(-1))
