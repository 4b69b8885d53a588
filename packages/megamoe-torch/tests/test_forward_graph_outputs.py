"""When a replayed forward's static output is free to be written again (forward_graphs.py): only
while no tensor of a caller, a view included, shares its storage. CPU: the rule is the storage's
use count, which needs no GPU."""

from __future__ import annotations

import torch
from megamoe_torch.forward_graphs import _free_graph, _Graph


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
