"""The gradients the GPU layer tests compare: a bf16 layer's on backend 'auto' (a forward that
autograd records runs on grouped_mm) and on the reference backend, beside the same layer's in
fp32 on the reference backend."""

from dataclasses import replace

import torch
from megamoe_torch import MegaMoE


def bf16_and_fp32_gradients(layer: MegaMoE, parameters: tuple[str, ...], tokens: int = 77):
    """[(auto's, the reference backend's, the fp32 layer's) gradient] of x and of each named
    parameter of the bf16 `layer`, for the loss sum(y * probe) on fixed random x and probe;
    the layer is left on backend 'auto'."""
    exact = MegaMoE(replace(layer.config, backend="reference"), device="cuda")
    exact.load_state_dict(layer.state_dict())  # the same weights, in fp32
    hidden = layer.config.hidden_size
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator).to(torch.bfloat16)
    probe = torch.randn(tokens, hidden, device="cuda", generator=generator)

    def gradients(module, x):
        module.zero_grad()
        leaf = x.clone().requires_grad_()
        (module(leaf).float() * probe).sum().backward()
        return [leaf.grad, *(module.get_parameter(name).grad for name in parameters)]

    by_backend = {}
    for backend in ("auto", "reference"):
        layer.use_backend(backend)
        by_backend[backend] = gradients(layer, x)
    layer.use_backend("auto")
    fp32 = gradients(exact, x.float())
    return list(zip(by_backend["auto"], by_backend["reference"], fp32, strict=True))
