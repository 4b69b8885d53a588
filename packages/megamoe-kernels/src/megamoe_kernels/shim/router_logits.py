"""Stable API of the router-logits kernel (drop/local_router.py): checks, compile cache, launches.

Shape legend: T tokens, E experts, H hidden size.

`RouterLogitsLauncher` (`router_logits_launcher(...)`): logits_TE = x_TH @ weight_EH^T (+ bias_E)
with fp32 accumulation, for up to ROUTER_LOGITS_MAX_TOKENS tokens (decode steps), rounded to
float32 or bfloat16 logits. x and the weight are bf16, H a multiple of 8, both contiguous. The
bias (gpt-oss's router) is added in fp32 after the sum. The kernel is launched with programmatic
dependent launch and lets the routing kernel after it be scheduled early (docs/kernels-design.md,
"The router-logits kernel"). `router_logits_faster_tokens(E, H)`: up to how many tokens it beats a
GEMM library for a router of that size (measured).

Compiled once per (E, H, logits dtype, bias dtype or none, token block, device) for CuTe DSL's
TVM-FFI launch path (torch tensors as they are, launched on torch's current stream, so CUDA graphs
capture it); T is a dynamic dim. The token block (tokens per CTA: 1, 2, 4 or 8) is the smallest
that holds T, 8 from 8 tokens on, so one token computes one sum per thread, not eight.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

from megamoe_kernels.shim.local_layer import _check_tensor, _compile, _cutlass_dtype, _drop_route

LOGITS_DTYPES = (torch.float32, torch.bfloat16)
BIAS_DTYPES = (torch.float32, torch.bfloat16)
TOKEN_BLOCKS = (1, 2, 4, 8)  # the kernel's compile-time tokens per CTA; the last is its maximum
# a GEMV: every block of 8 tokens reads the whole weight again, so past a few
# blocks a GEMM library's tiles are the right tool
ROUTER_LOGITS_MAX_TOKENS = 64
# router_logits_faster_tokens: the weight bytes a launch may read (once per token block)
# and still beat the GEMM library, measured (docs/benchmarks.md, "Router logits at decode")
ROUTER_LOGITS_WEIGHT_READ_BYTES = 4 << 20
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
        self._compiled: dict[int, Callable] = {}

    def compile(self, tokens: int = 1) -> Callable:
        """The kernel compiled for `tokens` tokens' block (token_block), compiling it if needed."""
        block = token_block(tokens)
        compiled = self._compiled.get(block)
        if compiled is None:
            compiled = self._compiled[block] = _compile(
                (*self._key, block), lambda: self._compile(block)
            )
        return compiled

    def _compile(self, block: int) -> Callable:
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_stream

        from megamoe_kernels.shim.ffi_launch import row_major

        _drop_route()  # sets the architecture without a GPU
        from megamoe_kernels.drop.local_router import ROUTER_MAX_TOKEN_BLOCK, router_logits

        assert block <= ROUTER_MAX_TOKEN_BLOCK, (block, ROUTER_MAX_TOKEN_BLOCK)

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
    library: while its token blocks read at most ROUTER_LOGITS_WEIGHT_READ_BYTES of the weight
    (each block reads all of it), and always one block (a GEMM reads the weight once too), at
    most ROUTER_LOGITS_MAX_TOKENS. Measured through whole forwards (scripts/router_ab.py): the
    kernel won at qwen3-30b-a3b (0.5 MB) up to 64 tokens, at gpt-oss-120b (0.7 MB) up to 40,
    at dsv3 (3.7 MB) up to 8 (one block), and lost past them."""
    block = TOKEN_BLOCKS[-1]
    weight_bytes = num_experts * hidden_size * 2
    blocks = max(1, ROUTER_LOGITS_WEIGHT_READ_BYTES // max(weight_bytes, 1))
    return min(ROUTER_LOGITS_MAX_TOKENS, blocks * block)


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
