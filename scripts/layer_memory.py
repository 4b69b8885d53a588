"""The memory a layer holds once it has run: its parameters, and the expert weights its backend
prepared beside them (a storage the parameters do not share), per backend and, for geometries
with shared experts, per shared-experts path.

    python3 scripts/layer_memory.py --geometry qwen3-30b-a3b mixtral-8x7b dsv3 gpt-oss-120b

For each layer (random bf16 weights at the geometry's real size, one at a time): the bytes of
the parameters and buffers, of the routed experts' w13 and w2, and of the prepared weights'
storages that no parameter shares, after a forward of `--tokens` tokens; "x routed": those
prepared bytes over the routed experts' bytes. Storages are counted once however many tensors
view them. A CPU runs the tiny geometry on the reference backend:

    python3 scripts/layer_memory.py --geometry tiny-qwen3 --device cpu --backends reference
"""

from __future__ import annotations

import argparse
from dataclasses import fields, is_dataclass

import torch
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import format_columns
from megamoe_torch import bench

GiB = 1 << 30


def storages(tensors) -> dict[tuple, int]:
    """{(device, storage address): bytes} of the storages under `tensors`."""
    out = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            out[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return out


def prepared_tensors(layer) -> list[torch.Tensor]:
    """The tensors of the weights the layer's backend prepared (its cache's value: the prepared
    weights and, with shared experts in the batch, the routed experts' views of them)."""
    value = layer._prepared._value  # a diagnostic's look at the layer's cache
    found = []
    for item in value if isinstance(value, tuple) else (value,):
        if is_dataclass(item):
            found += [getattr(item, field.name) for field in fields(item)]
    return [tensor for tensor in found if isinstance(tensor, torch.Tensor)]


@torch.no_grad()
def measure(geometry_name, backend, path, *, device, tokens) -> list[str] | None:
    geometry = GEOMETRIES[geometry_name]
    layer = bench.build_layer(geometry, device=device, dtype=torch.bfloat16)
    if path is not None:
        layer = bench.with_capacity(layer, layer.config.capacity, shared_experts_path=path)
    if backend not in bench.layer_backends(layer, [backend])[0]:
        return None
    layer.use_backend(backend)
    x = torch.randn(tokens, geometry.hidden_size, device=device, dtype=torch.bfloat16)
    layer(x)
    held = storages(list(layer.parameters()) + list(layer.buffers()))
    routed = sum(storages([layer.w13, layer.w2]).values())
    prepared = storages(prepared_tensors(layer))
    beside = sum(size for key, size in prepared.items() if key not in held)
    return [
        geometry_name,
        backend,
        path or "-",
        f"{sum(held.values()) / GiB:.3f}",
        f"{routed / GiB:.3f}",
        f"{beside / GiB:.3f}",
        f"{beside / routed:.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", nargs="+", required=True, choices=sorted(GEOMETRIES))
    parser.add_argument("--backends", nargs="+", default=["cutedsl", "grouped_mm"])
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for name in args.geometry:
        paths = ["auto", "side_stream"] if GEOMETRIES[name].num_shared_experts else [None]
        for backend in args.backends:
            for path in paths:
                row = measure(name, backend, path, device=device, tokens=args.tokens)
                if row is not None:
                    rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print(
        format_columns(
            [
                "geometry",
                "backend",
                "shared experts",
                "parameters GiB",
                "routed experts GiB",
                "prepared beside GiB",
                "x routed",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
