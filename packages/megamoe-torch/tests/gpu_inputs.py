"""The inputs the GPU layer tests feed a layer: fresh random tokens, over an allocator whose
free memory reads NaN."""

import torch


def poison_allocator() -> None:
    """The next allocations reuse this memory: anything a forward leaves unwritten reads NaN."""
    torch.full((256 << 20,), float("nan"), dtype=torch.float32, device="cuda")


def fresh_tokens(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """bf16 [tokens, hidden] standard normal tokens on the GPU, from `seed`."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens, hidden, device="cuda", generator=generator).to(torch.bfloat16)
