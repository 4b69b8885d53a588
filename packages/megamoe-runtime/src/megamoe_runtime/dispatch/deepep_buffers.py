"""Checks of the DeepEP buffer a caller hands DeepEPDispatcher, before any DeepEP call.

Which API a buffer offers is read from the names it has (megamoe never imports deep_ep), and
its sizes are checked against DeepEP's own size hints for the layer, so a buffer of another
kind or too small is refused with what was expected instead of failing inside DeepEP.
"""

from __future__ import annotations

from typing import Any

# FP8 tokens carry one float32 scale per 128 channels (DeepEP's recipe and megamoe's)
FP8_SCALE_GROUP = 128

# what the adapter calls on each DeepEP buffer API (methods and attributes, by name)
V1_BUFFER_NEEDS = (
    "get_dispatch_layout",
    "dispatch",
    "combine",
    "low_latency_dispatch",
    "low_latency_combine",
    "get_dispatch_config",
    "get_combine_config",
    "get_low_latency_rdma_size_hint",
    "clean_low_latency_buffer",
    "capture",
    "group",
    "rank",
    "group_size",
    "num_nvl_bytes",
    "num_rdma_bytes",
    "low_latency_mode",
)
V2_BUFFER_NEEDS = (
    "dispatch",
    "combine",
    "get_buffer_size_hint",
    "capture",
    "group",
    "rank_idx",
    "num_ranks",
    "num_bytes",
    "num_max_tokens_per_rank",
)


def deepep_api_of(buffer: Any) -> str:
    """'v1' (deep_ep.Buffer) or 'v2' (deep_ep.ElasticBuffer), from the names the buffer has;
    raises TypeError naming what is missing for anything else."""
    missing = {
        api: [name for name in needs if not hasattr(buffer, name)]
        for api, needs in (("v1", V1_BUFFER_NEEDS), ("v2", V2_BUFFER_NEEDS))
    }
    for api, lacking in missing.items():
        if not lacking:
            return api
    closest = min(missing, key=lambda api: len(missing[api]))
    raise TypeError(
        f"buffer must be a deep_ep.Buffer (DeepEP V1, normal or low_latency_mode) or a "
        f"deep_ep.ElasticBuffer (DeepEP V2), built by the caller; got {type(buffer).__name__}, "
        f"which lacks {missing[closest]} of the {closest} buffer's API"
    )


def check_v1_normal_buffer(
    buffer: Any,
    *,
    hidden_size: int,
    world_size: int,
    fp8_dispatch: bool,
    dispatch_config: Any,
    combine_config: Any,
) -> tuple[Any, Any]:
    """The dispatch and combine configs (DeepEP's recommended ones unless given), after checking
    that the V1 buffer holds the NVLink and RDMA bytes they need at this hidden size."""
    try:
        dispatch_config = dispatch_config or buffer.get_dispatch_config(world_size)
        combine_config = combine_config or buffer.get_combine_config(world_size)
    except AssertionError as failure:  # DeepEP's table has no entry for this group size
        raise ValueError(
            f"DeepEP recommends no dispatch/combine config for {world_size} ranks ({failure}); "
            "pass dispatch_config= and combine_config= (deep_ep.Config)"
        ) from failure
    # DeepEP sizes its queues by max(element size, 2) bytes per channel: bf16 and FP8 alike
    hidden_bytes = hidden_size * 2
    needed_nvl = max(
        config.get_nvl_buffer_size_hint(hidden_bytes, world_size)
        for config in (dispatch_config, combine_config)
    )
    needed_rdma = max(
        config.get_rdma_buffer_size_hint(hidden_bytes, world_size)
        for config in (dispatch_config, combine_config)
    )
    if buffer.num_nvl_bytes < needed_nvl or buffer.num_rdma_bytes < needed_rdma:
        raise ValueError(
            f"the deep_ep.Buffer holds {buffer.num_nvl_bytes} NVLink and "
            f"{buffer.num_rdma_bytes} RDMA bytes; normal mode at hidden {hidden_size} on "
            f"{world_size} ranks needs {needed_nvl} and {needed_rdma} (max of "
            "config.get_nvl_buffer_size_hint / get_rdma_buffer_size_hint(hidden x 2, ranks) "
            "over the dispatch and combine configs): build the buffer with at least those"
        )
    if fp8_dispatch and hidden_size % FP8_SCALE_GROUP:
        raise ValueError(
            f"FP8 dispatch takes a hidden size divisible by {FP8_SCALE_GROUP} (one scale per "
            f"{FP8_SCALE_GROUP} channels), got {hidden_size}"
        )
    return dispatch_config, combine_config


def check_v1_low_latency_buffer(
    buffer: Any,
    *,
    hidden_size: int,
    world_size: int,
    fp8_dispatch: bool,
    num_experts: int,
    max_tokens_per_rank: int | None,
) -> None:
    """Raises unless the V1 buffer was built for low latency, with the RDMA bytes DeepEP's
    size hint asks for these sizes, which its kernels take."""
    if not buffer.low_latency_mode:
        raise ValueError(
            "mode='low_latency' needs a deep_ep.Buffer built with low_latency_mode=True (and "
            "num_rdma_bytes from Buffer.get_low_latency_rdma_size_hint); this one was built "
            "for normal mode: use mode='normal' with it"
        )
    if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1:
        raise ValueError(
            f"mode='low_latency' needs max_tokens_per_rank (DeepEP's "
            f"num_max_dispatch_tokens_per_rank, the same on every rank), got "
            f"{max_tokens_per_rank!r}"
        )
    divisor = 4 * FP8_SCALE_GROUP if fp8_dispatch else FP8_SCALE_GROUP
    if hidden_size % divisor:
        raise ValueError(
            f"DeepEP's low-latency kernels take a hidden size divisible by {divisor}"
            f"{' with FP8 dispatch' if fp8_dispatch else ''}, got {hidden_size}"
        )
    if world_size * max_tokens_per_rank % 4:
        raise ValueError(
            f"DeepEP's low-latency receive layout needs ranks x max_tokens_per_rank divisible "
            f"by 4 (TMA), got {world_size} x {max_tokens_per_rank}"
        )
    needed = buffer.get_low_latency_rdma_size_hint(
        max_tokens_per_rank, hidden_size, world_size, num_experts
    )
    if buffer.num_rdma_bytes < needed:
        raise ValueError(
            f"the deep_ep.Buffer holds {buffer.num_rdma_bytes} RDMA bytes; low-latency mode "
            f"with max_tokens_per_rank={max_tokens_per_rank}, hidden {hidden_size}, "
            f"{world_size} ranks and {num_experts} experts needs {needed} "
            "(Buffer.get_low_latency_rdma_size_hint): build it with at least that, or lower "
            "max_tokens_per_rank"
        )


def check_v2_buffer(
    buffer: Any,
    *,
    mode: str,
    hidden_size: int,
    world_size: int,
    fp8_dispatch: bool,
    top_k: int,
    max_tokens_per_rank: int | None,
) -> int:
    """The tokens per rank the V2 buffer serves (given, else its own), after checking that the
    adapter can drive it in `mode` and that it holds the bytes DeepEP's size hint asks for."""

    if mode != "normal":
        raise ValueError(
            "DeepEP V2's ElasticBuffer has no low-latency API (its README: 0-SM RDMA "
            "low-latency EP is no longer supported): use mode='normal' with it, or a V1 "
            "deep_ep.Buffer built with low_latency_mode=True"
        )
    if fp8_dispatch:
        raise ValueError(
            "FP8 dispatch through a V2 ElasticBuffer is not supported by this adapter; use "
            "fp8_dispatch=False, or a V1 deep_ep.Buffer"
        )
    max_tokens = max_tokens_per_rank or buffer.num_max_tokens_per_rank
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(
            "a V2 ElasticBuffer built from num_bytes has no num_max_tokens_per_rank: pass "
            f"max_tokens_per_rank, got {max_tokens_per_rank!r}"
        )
    needed = buffer.get_buffer_size_hint(
        buffer.group,
        max_tokens,
        hidden_size,
        num_topk=top_k,
        use_fp8_dispatch=False,
        allow_hybrid_mode=getattr(buffer, "allow_hybrid_mode", True),
        allow_multiple_reduction=getattr(buffer, "allow_multiple_reduction", True),
    )
    if buffer.num_bytes < needed:
        raise ValueError(
            f"the deep_ep.ElasticBuffer holds {buffer.num_bytes} bytes; {max_tokens} tokens "
            f"per rank of hidden {hidden_size}, top-{top_k}, need {needed} "
            "(ElasticBuffer.get_buffer_size_hint): build it with at least that"
        )
    return max_tokens
