"""Expert-parallel helpers: which rank owns which experts, and which dispatcher a layer gets.

Process groups always come from the caller; nothing here creates one.

| dispatcher | where                                   | what                                          |
|------------|-----------------------------------------|-----------------------------------------------|
| torch      | any torch.distributed backend (gloo too) | all_to_all_single; one host sync per dispatch |
| nvshmem    | CUDA GPUs of one host + nvshmem4py       | megamoe's symmetric-memory kernels, no sync   |

`auto` picks nvshmem where it can run, else torch, and says why. A dispatcher the caller built
(`DeepEPDispatcher` over its deep_ep buffer) is injected instead: `injected_dispatcher_group`
checks it against the layer.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

from megamoe_runtime.dispatch.checks import check_wire_dtypes, experts_per_rank
from megamoe_runtime.dispatch.torch_distributed import TorchDistributedDispatcher

DISPATCHER_NAMES = ("torch", "nvshmem")
# how an expert-parallel combine sums a token's top-k outputs (make_expert_parallel_dispatcher)
COMBINE_ORDERS = ("exact", "owner_partials")


def group_rank_and_size(process_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) in `process_group`; (0, 1) without one (a single-GPU layer)."""
    if process_group is None:
        return 0, 1
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "a process_group was given but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first"
        )
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def local_expert_range(num_experts: int, process_group: dist.ProcessGroup | None) -> range:
    """The global ids of the experts this rank owns: a contiguous block of E / world."""
    rank, world = group_rank_and_size(process_group)
    local = experts_per_rank(num_experts, world)
    return range(rank * local, (rank + 1) * local)


def nvshmem_status(device: torch.device | str) -> tuple[bool, str]:
    """(can run, why) for the symmetric-memory dispatcher on `device`."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"the nvshmem dispatcher needs CUDA tensors, the layer is on {device}"
    if importlib.util.find_spec("nvshmem") is None:
        return False, "nvshmem4py is not installed (pip install 'megamoe-runtime[nvshmem]')"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return False, f"the dispatch kernels are built for sm_90a; this GPU is sm_{major}{minor}"
    return True, "CUDA GPU with nvshmem4py"


def select_dispatcher(requested: str, device: torch.device | str) -> tuple[str, str]:
    """Resolves 'auto' (or checks an explicit name) to (dispatcher name, reason)."""
    if requested not in ("auto", *DISPATCHER_NAMES):
        raise ValueError(
            f"dispatcher must be one of {('auto', *DISPATCHER_NAMES)}, got {requested!r}"
        )
    available, reason = nvshmem_status(device)
    if requested == "nvshmem":
        if not available:
            raise ValueError(f"dispatcher 'nvshmem' cannot run: {reason}; use 'torch'")
        return "nvshmem", reason
    if requested == "torch":
        return "torch", "requested"
    if available:
        return "nvshmem", f"auto: nvshmem ({reason})"
    return "torch", f"auto: torch (nvshmem skipped: {reason})"


def make_expert_parallel_dispatcher(
    name: str,
    *,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    process_group: dist.ProcessGroup,
    capacity: int | None,
    max_tokens_per_rank: int,
    layer_name: str = "moe",
    combine_order: str = "exact",
    dispatch_dtype: str = "bf16",
    combine_dtype: str = "bf16",
):
    """Builds the dispatcher named `name` ('torch' or 'nvshmem') for one layer.

    combine_order: 'exact' (the single-GPU summation, bitwise) or 'owner_partials' (the nvshmem
    dispatcher's owner-side partial sums: fewer NVLink bytes, one more bf16 rounding);
    dispatch_dtype, combine_dtype: 'bf16' or 'fp8', what crosses NVLink in the nvshmem
    dispatcher's dispatch and combine (SymmetricDispatcher). The torch dispatcher always
    combines exactly and moves bf16 rows."""
    if combine_order not in COMBINE_ORDERS:
        raise ValueError(f"combine_order must be one of {COMBINE_ORDERS}, got {combine_order!r}")
    check_wire_dtypes(
        dispatch_dtype=dispatch_dtype, combine_dtype=combine_dtype, hidden_size=hidden_size
    )
    if name == "torch":
        return TorchDistributedDispatcher(
            num_experts, process_group=process_group, capacity=capacity, check_ids=False
        )
    if name == "nvshmem":
        from megamoe_runtime.dispatch.symmetric import SymmetricDispatcher

        return SymmetricDispatcher(
            num_experts,
            top_k=top_k,
            hidden_size=hidden_size,
            dtype=dtype,
            device=device,
            process_group=process_group,
            max_tokens_per_rank=max_tokens_per_rank,
            capacity=capacity,
            layer_name=layer_name,
            combine_partial_sums=combine_order == "owner_partials",
            dispatch_dtype=dispatch_dtype,
            combine_dtype=combine_dtype,
        )
    raise ValueError(f"dispatcher must be one of {DISPATCHER_NAMES}, got {name!r}")


def group_ranks(process_group: dist.ProcessGroup) -> list[int]:
    """The global ranks of `process_group`, in group-rank order."""
    return dist.get_process_group_ranks(process_group)


def injected_dispatcher_group(
    dispatcher,
    process_group: dist.ProcessGroup | None,
    *,
    num_experts: int,
    top_k: int,
    hidden_size: int,
) -> dist.ProcessGroup | None:
    """The expert-parallel group of a layer handed `dispatcher` (built by the caller, e.g. a
    DeepEPDispatcher over its deep_ep buffer): `process_group` when given, which must hold the
    same ranks in the same order as the dispatcher's group, else the dispatcher's own. Raises
    unless the dispatcher was built for the layer's experts, top-k and hidden size, and splits
    the experts as the layer's weights will be (E / W contiguous experts per rank)."""
    own_group = getattr(dispatcher, "process_group", None)
    if process_group is None:
        process_group = own_group
    elif own_group is not None and group_ranks(process_group) != group_ranks(own_group):
        raise ValueError(
            f"process_group holds ranks {group_ranks(process_group)} but the dispatcher's group "
            f"(its buffer's) holds {group_ranks(own_group)}: pass the group the buffer was built "
            "on, or leave process_group out to use it"
        )
    for name, wanted in (
        ("num_experts", num_experts),
        ("top_k", top_k),
        ("hidden_size", hidden_size),
    ):
        value = getattr(dispatcher, name, wanted)
        if value != wanted:
            raise ValueError(
                f"the dispatcher was built for {name}={value}, the layer has {name}={wanted}"
            )
    _, world = group_rank_and_size(process_group)
    expected_local = experts_per_rank(num_experts, world)
    if dispatcher.num_local_experts != expected_local:
        raise ValueError(
            f"the dispatcher gives each rank {dispatcher.num_local_experts} experts; the layer's "
            f"{num_experts} experts over {world} ranks give {expected_local}"
        )
    return process_group
