"""The nodes and dependencies a capture of the layer's launched forward records: each node's
type (a kernel's name), and each edge's type, programmatic (the next kernel may start early,
programmatic dependent launch) or full. Run on the GPU machine from the project root:

    python3 scripts/graph_edges.py --geometry qwen3-30b-a3b --tokens 2048
"""

from __future__ import annotations

import argparse

import torch
from cuda.bindings import driver, runtime
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_torch.bench import build_layer, routed_tokens, with_capacity


def node_label(node) -> str:
    """The node's type, and a kernel node's function name."""
    _, kind = runtime.cudaGraphNodeGetType(node)
    label = kind.name.removeprefix("cudaGraphNodeType")
    if label == "Kernel":
        _, params = driver.cuGraphKernelNodeGetParams(driver.CUgraphNode(int(node)))
        _, name = driver.cuFuncGetName(params.func)
        label += " " + (name.decode() if isinstance(name, bytes) else str(name))[:80]
    return label


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    device = torch.device("cuda")
    base = build_layer(GEOMETRIES[args.geometry], device=device, dtype=torch.bfloat16)
    layer = with_capacity(base, None, eager_graph_tokens=0)
    layer.use_backend("cutedsl")
    x_TH, _, _ = routed_tokens(base, args.tokens)
    for _ in range(2):  # compiles outside the capture
        layer(x_TH)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        layer(x_TH)
    raw = runtime.cudaGraph_t(init_value=graph.raw_cuda_graph())
    _, _, count = runtime.cudaGraphGetNodes(raw, 0)
    _, nodes, _ = runtime.cudaGraphGetNodes(raw, count)
    labels = {int(node): f"n{i}" for i, node in enumerate(nodes)}
    for node in nodes:
        print(f"{labels[int(node)]}: {node_label(node)}")
    *_, count = runtime.cudaGraphGetEdges(raw, 0)
    _, sources, targets, edge_data, _ = runtime.cudaGraphGetEdges(raw, count)
    programmatic = runtime.cudaGraphDependencyType.cudaGraphDependencyTypeProgrammatic
    for source, target, data in zip(sources, targets, edge_data, strict=True):
        kind = "programmatic" if int(data.type) == int(programmatic) else "full"
        print(f"{labels[int(source)]} -> {labels[int(target)]}: {kind}")


if __name__ == "__main__":
    main()
