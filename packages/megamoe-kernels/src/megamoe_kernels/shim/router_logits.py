"""Stable API of the router-logits kernel (drop/local_router.py): checks, compile cache, launches.

Shape legend: T tokens, E experts, H hidden size.

`RouterLogitsLauncher` (`router_logits_launcher(...)`): logits_TE = x_TH @ weight_EH^T (+ bias_E)
with fp32 accumulation, for up to ROUTER_LOGITS_MAX_TOKENS tokens (decode steps and small
prefills), rounded to float32 or bfloat16 logits. x and the weight are bf16, H a multiple of 8,
both contiguous. The bias (gpt-oss's router) is added in fp32 after the sum. The kernel is
launched with programmatic dependent launch (docs/kernels-design.md, "The router-logits
kernel"). `router_logits_faster_tokens(E, H)`: up to how many tokens it beats a GEMM library for
a router of that size (measured).

The grid (`grid_shape`): a CTA per block of tokens (1, 2, 4 or 8: the smallest that holds T,
so one token computes one sum per thread, not eight; 8 past 8 tokens) and block of experts (as
many as a thread's registers hold while the grid keeps 128 CTAs: each token row a CTA loads
serves them all); up to 8 tokens the routing kernel after it is scheduled at its top, past 8 as
its CTAs exit. The logits have the same bits whatever the grid. Compiled once per (E, H, logits
dtype, bias dtype or none, grid shape, device) for CuTe DSL's TVM-FFI launch path (torch tensors
as they are, launched on torch's current stream, so CUDA graphs capture it); T is a dynamic dim.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

from megamoe_kernels.shim.local_layer import _check_tensor, _compile, _cutlass_dtype, _drop_route

LOGITS_DTYPES = (torch.float32, torch.bfloat16)
BIAS_DTYPES = (torch.float32, torch.bfloat16)
TOKEN_BLOCKS = (1, 2, 4, 8)  # the kernel's compile-time tokens per CTA; the last is its maximum
# the kernel's compile-time experts per CTA (all at most the drop's ROUTER_MAX_EXPERT_BLOCK)
EXPERT_BLOCKS = (1, 2, 4, 8)
# weight vectors (16 bytes, 4 registers) a thread holds across the experts of its CTA
ROUTER_LOGITS_HELD_VECTORS = 16
# H elements one pass of a CTA covers: 128 threads, a 16-byte vector (8 bf16) each
ROUTER_LOGITS_CTA_STEP = 1024
# expert_block: a CTA takes several experts while the grid keeps at least this many CTAs
# (measured: docs/benchmarks.md, "Router logits at decode")
ROUTER_LOGITS_MIN_CTAS = 128
# experts per CTA a launcher's grid takes in place of expert_block's (None: the rule; capped
# by max_expert_block), for an A/B in one process (scripts/router_ab.py --expert-blocks)
ROUTER_LOGITS_EXPERT_BLOCK: int | None = None
# every block of 8 tokens reads the whole weight again: past the layer's own graphs (128
# tokens, eager_graph_tokens) a GEMM library's tiles are the right tool
ROUTER_LOGITS_MAX_TOKENS = 128
# router_logits_faster_tokens: the bytes a launch may read (weight rows and token rows, as
# router_logits_read_bytes counts them) and still beat the GEMM library, measured
# (docs/benchmarks.md, "Router logits at decode")
ROUTER_LOGITS_READ_BYTES = 40 << 20
# a thread holds ceil(H / 1024) 16-byte vectors of its weight row in registers
ROUTER_LOGITS_MAX_HIDDEN = 16384


def router_logits_problems(
    *,
    num_experts: int,
    hidden_size: int,
    logits_dtype: torch.dtype = torch.float32,
    bias_dtype: torch.dtype | None = None,
) -> list[str]:
    """Why the router-logits kernel cannot compute this router ([] when it can)."""
    problems = []
    if num_experts < 1:
        problems.append(f"num_experts={num_experts} must be at least 1")
    if not 8 <= hidden_size <= ROUTER_LOGITS_MAX_HIDDEN or hidden_size % 8:
        problems.append(
            f"hidden_size={hidden_size} must be a multiple of 8 (16-byte vectors) in "
            f"[8, {ROUTER_LOGITS_MAX_HIDDEN}] (a weight row held in registers)"
        )
    if logits_dtype not in LOGITS_DTYPES:
        problems.append(f"logits_dtype={logits_dtype} is not one of {LOGITS_DTYPES}")
    if bias_dtype is not None and bias_dtype not in BIAS_DTYPES:
        problems.append(f"bias_dtype={bias_dtype} is not None or one of {BIAS_DTYPES}")
    return problems


class RouterLogitsLauncher:
    """The router-logits kernel for one router's (E, H, dtypes), compiled on first use; a call
    allocates the logits and launches one kernel (none for T = 0)."""

    def __init__(
        self,
        *,
        num_experts: int,
        hidden_size: int,
        logits_dtype: torch.dtype = torch.float32,
        bias_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        compile_only: bool = False,
    ):
        problems = router_logits_problems(
            num_experts=num_experts,
            hidden_size=hidden_size,
            logits_dtype=logits_dtype,
            bias_dtype=bias_dtype,
        )
        if problems:
            raise ValueError(
                "the router-logits kernel cannot serve this router: " + "; ".join(problems)
            )
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.logits_dtype, self.bias_dtype = logits_dtype, bias_dtype
        self.device = None if device is None else torch.device(device)
        device_index = -1 if compile_only or self.device is None else self.device.index
        self._key = (
            "router_logits",
            num_experts,
            hidden_size,
            logits_dtype,
            bias_dtype,
            device_index,
        )
        self._compiled: dict[tuple[int, int, bool], Callable] = {}

    def grid_shape(self, tokens: int) -> tuple[int, int, bool]:
        """The kernel's (tokens per CTA, experts per CTA, dependents early) for T = `tokens`:
        grid_shape's, with ROUTER_LOGITS_EXPERT_BLOCK's experts per CTA where set."""
        tokens_per_cta, experts_per_cta, early = grid_shape(
            tokens, self.num_experts, self.hidden_size
        )
        if ROUTER_LOGITS_EXPERT_BLOCK is not None:
            most = max_expert_block(self.num_experts, self.hidden_size)
            experts_per_cta = min(ROUTER_LOGITS_EXPERT_BLOCK, most)
        return tokens_per_cta, experts_per_cta, early

    def compile(self, tokens: int = 1) -> Callable:
        """The kernel compiled for `tokens` tokens' grid shape, compiling it if needed."""
        shape = self.grid_shape(tokens)
        compiled = self._compiled.get(shape)
        if compiled is None:
            compiled = self._compiled[shape] = _compile(
                (*self._key, *shape), lambda: self._compile(*shape)
            )
        return compiled

    def _compile(self, block: int, experts_block: int, early_dependents: bool) -> Callable:
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_stream

        from megamoe_kernels.shim.ffi_launch import row_major

        _drop_route()  # sets the architecture without a GPU
        from megamoe_kernels.drop.local_router import (
            ROUTER_MAX_EXPERT_BLOCK,
            ROUTER_MAX_TOKEN_BLOCK,
            router_logits,
        )

        assert block <= ROUTER_MAX_TOKEN_BLOCK, (block, ROUTER_MAX_TOKEN_BLOCK)
        assert experts_block <= ROUTER_MAX_EXPERT_BLOCK, (experts_block, ROUTER_MAX_EXPERT_BLOCK)

        tokens = cute.sym_int32(symbol="tokens")
        experts, hidden = self.num_experts, self.hidden_size
        return cute.compile(
            router_logits,
            row_major(cutlass.BFloat16, (tokens, hidden)),
            row_major(cutlass.BFloat16, (experts, hidden)),
            None
            if self.bias_dtype is None
            else row_major(_cutlass_dtype(self.bias_dtype), (experts,)),
            row_major(_cutlass_dtype(self.logits_dtype), (tokens, experts)),
            hidden,
            block,
            experts_block,
            early_dependents,
            make_fake_stream(use_tvm_ffi_env_stream=True),
            options="--enable-tvm-ffi",
        )

    def __call__(
        self, x_TH: torch.Tensor, weight_EH: torch.Tensor, *, bias_E: torch.Tensor | None = None
    ) -> torch.Tensor:
        """logits_TE (logits_dtype) of the T = x_TH.shape[0] <= ROUTER_LOGITS_MAX_TOKENS tokens."""
        tokens = x_TH.shape[0]
        if tokens > ROUTER_LOGITS_MAX_TOKENS:
            raise ValueError(
                f"x has {tokens} tokens; the router-logits kernel takes at most "
                f"{ROUTER_LOGITS_MAX_TOKENS} (use a GEMM: torch.mm)"
            )
        if (bias_E is None) != (self.bias_dtype is None):
            raise ValueError(
                f"bias_E is {'None' if bias_E is None else 'given'} but the launcher was built "
                f"with bias_dtype={self.bias_dtype}: build it with the bias dtype, or None for none"
            )
        logits_TE = torch.empty(
            (tokens, self.num_experts), dtype=self.logits_dtype, device=x_TH.device
        )
        if tokens == 0:
            return logits_TE
        compiled = self.compile(tokens)
        try:
            compiled(x_TH, weight_EH, bias_E, logits_TE)
        except Exception as failure:
            self._explain(failure, x_TH, weight_EH, bias_E)
        return logits_TE

    def _explain(self, failure, x_TH, weight_EH, bias_E) -> None:
        """Re-raises a refused launch as an error that names the argument at fault."""
        _check_tensor("x", x_TH, torch.bfloat16, (None, self.hidden_size), failure)
        _check_tensor(
            "weight", weight_EH, torch.bfloat16, (self.num_experts, self.hidden_size), failure
        )
        if bias_E is not None:
            _check_tensor("bias", bias_E, self.bias_dtype, (self.num_experts,), failure)
        tensors = [("x", x_TH), ("weight", weight_EH), ("bias", bias_E)]
        devices = {name: t.device for name, t in tensors if t is not None}
        if len(set(devices.values())) > 1 or not x_TH.is_cuda:
            raise ValueError(
                f"x, weight and bias must sit on one CUDA device, got {devices}"
            ) from failure
        raise failure


@lru_cache(maxsize=256)
def router_logits_faster_tokens(num_experts: int, hidden_size: int) -> int:
    """Up to how many tokens the kernel computes a bf16 router of (E, H) faster than the GEMM
    library: the most, in whole token blocks up to ROUTER_LOGITS_MAX_TOKENS, up to which every
    launch reads at most ROUTER_LOGITS_READ_BYTES (router_logits_read_bytes), and always one
    block (a GEMM reads the weight once too). Measured through whole forwards
    (scripts/router_ab.py): the kernel's router beat the GEMM library's at qwen3-30b-a3b
    (0.5 MB), gpt-oss-120b (0.7 MB) and mixtral-8x7b up to 128 tokens (9-34 MiB read at 128),
    and at dsv3 (3.7 MB) up to 16 (35 MiB; at 32 tokens, 70 MiB, it lost)."""
    block = bound = TOKEN_BLOCKS[-1]
    for tokens in range(block, ROUTER_LOGITS_MAX_TOKENS + 1, block):
        if router_logits_read_bytes(tokens, num_experts, hidden_size) > ROUTER_LOGITS_READ_BYTES:
            break
        bound = tokens
    return bound


def router_logits_read_bytes(tokens: int, num_experts: int, hidden_size: int) -> int:
    """The bytes a launch for T = `tokens` reads: the whole weight once per token block, and the
    block's token rows once per CTA (grid_shape)."""
    tokens_per_cta, experts_per_cta, _ = grid_shape(tokens, num_experts, hidden_size)
    token_blocks = -(-tokens // tokens_per_cta)
    expert_blocks = -(-num_experts // experts_per_cta)
    row_bytes = hidden_size * 2
    return token_blocks * num_experts * row_bytes + expert_blocks * tokens * row_bytes


@lru_cache(maxsize=1024)
def grid_shape(tokens: int, num_experts: int, hidden_size: int) -> tuple[int, int, bool]:
    """The kernel's (tokens per CTA, experts per CTA, dependents scheduled at its top) for T =
    `tokens` and a router of (E, H): token_block and expert_block; up to one token block
    (decode) the routing kernel is scheduled as the kernel starts (a forward 0.5 us faster at
    one token), past it as its CTAs exit (at 64 and 128 tokens a routing kernel scheduled early
    made forwards up to 4 us slower: docs/benchmarks.md, "Router logits at decode")."""
    decode = tokens <= TOKEN_BLOCKS[-1]
    return token_block(tokens), expert_block(tokens, num_experts, hidden_size), decode


def max_expert_block(num_experts: int, hidden_size: int) -> int:
    """The most experts a CTA may take for a router of (E, H): the largest of EXPERT_BLOCKS whose
    weight vectors a thread holds in ROUTER_LOGITS_HELD_VECTORS (ceil(H / 1024) per expert), and
    no more than E."""
    per_expert = -(-hidden_size // ROUTER_LOGITS_CTA_STEP)
    fitting = [
        block
        for block in EXPERT_BLOCKS
        if block == 1 or (block * per_expert <= ROUTER_LOGITS_HELD_VECTORS and block <= num_experts)
    ]
    return fitting[-1]


def expert_block(tokens: int, num_experts: int, hidden_size: int) -> int:
    """The kernel's experts per CTA for T = `tokens` and a router of (E, H): the most a thread's
    registers hold (a token row a CTA loads serves them all) that still leave the grid
    ROUTER_LOGITS_MIN_CTAS CTAs (fewer, larger CTAs were slower), one where none does."""
    token_blocks = -(-tokens // token_block(tokens))
    most = max_expert_block(num_experts, hidden_size)
    for block in reversed(EXPERT_BLOCKS):
        if block <= most and -(-num_experts // block) * token_blocks >= ROUTER_LOGITS_MIN_CTAS:
            return block
    return 1


def token_block(tokens: int) -> int:
    """The kernel's tokens per CTA for T = `tokens`: the smallest of TOKEN_BLOCKS holding them,
    else the largest."""
    return next((block for block in TOKEN_BLOCKS if tokens <= block), TOKEN_BLOCKS[-1])


def router_logits_launcher(**constants) -> RouterLogitsLauncher:
    """A RouterLogitsLauncher, kept per set of constants."""
    key = tuple(sorted(constants.items(), key=lambda item: item[0]))
    launcher = _ROUTER_LOGITS_LAUNCHERS.get(key)
    if launcher is None:
        launcher = _ROUTER_LOGITS_LAUNCHERS[key] = RouterLogitsLauncher(**constants)
    return launcher


_ROUTER_LOGITS_LAUNCHERS: dict[tuple, RouterLogitsLauncher] = {}
