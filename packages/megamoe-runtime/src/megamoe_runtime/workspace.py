"""Symmetric workspaces: NVSHMEM buffers pooled per process group, shared by every layer.

NVSHMEM (through nvshmem4py, the `megamoe-runtime[nvshmem]` extra) is initialised once per
process from the caller's torch.distributed group: rank 0 of the group creates a unique id and
broadcasts it over the group, then every rank joins with its group rank as PE. A process has one
NVSHMEM job, so one group per process: another group raises.

`SymmetricWorkspace.buffer(name, shape, dtype)` returns a pooled symmetric tensor: every MegaMoE
layer of the process asks for the same names, so layers share one set of buffers (a layer's
dispatch/combine pair completes before the next layer's dispatch, so sharing is safe). A request
larger than the pooled buffer reallocates it. Allocation and free are collective: every rank
must ask for the same buffers in the same order, which layers built from one config do.
`release_all_workspaces()` frees every buffer collectively and finalises NVSHMEM; call it at
shutdown (before torch.distributed.destroy_process_group). An atexit hook is the fallback.

Peer addresses: `peer_addresses(name)` is an int64 device tensor [W] holding where this rank
sees each PE's copy of the buffer (NVLink peer mappings; its own entry is the local address),
which the dispatch kernels index by destination rank.
"""

from __future__ import annotations

import atexit
import os
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DEFAULT_SYMMETRIC_HEAP_BYTES = 1 << 30  # NVSHMEM's default when NVSHMEM_SYMMETRIC_SIZE is unset
_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def symmetric_heap_bytes() -> int:
    """The per-rank symmetric heap NVSHMEM reserves (NVSHMEM_SYMMETRIC_SIZE, default 1 GiB)."""
    value = os.environ.get("NVSHMEM_SYMMETRIC_SIZE", "").strip()
    if not value:
        return DEFAULT_SYMMETRIC_HEAP_BYTES
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)[bB]?", value)
    if match is None:
        raise ValueError(
            f"NVSHMEM_SYMMETRIC_SIZE={value!r} is not a size; use bytes or a K/M/G/T suffix, e.g. 4G"
        )
    return int(float(match.group(1)) * _SIZE_SUFFIXES[match.group(2).upper()])


@dataclass
class _Buffer:
    tensor: torch.Tensor  # the allocation itself (free this one, never a view)
    peer_views: list[torch.Tensor]  # keeps the peer mappings alive while addresses are in use
    peer_addresses_W: torch.Tensor


@dataclass
class SymmetricWorkspace:
    """The pooled symmetric buffers of one process group on one device."""

    process_group: dist.ProcessGroup | None
    device: torch.device
    rank: int
    world_size: int
    _buffers: dict[str, _Buffer] = field(default_factory=dict)
    # bumped on every (re)allocation: users caching views re-fetch when it moves
    generation: int = 0
    # the layer whose expert-parallel dispatch on these buffers awaits its combine, if any: the
    # combine's counters follow the dispatch epoch, so dispatches and combines must alternate
    dispatch_awaiting_combine: str | None = None

    @property
    def allocated_bytes(self) -> int:
        return sum(b.tensor.numel() * b.tensor.element_size() for b in self._buffers.values())

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A symmetric tensor of at least `shape` (pooled under `name`); collective when it
        allocates. The result is zero-filled when first allocated."""
        numel = 1
        for extent in shape:
            numel *= extent
        pooled = self._buffers.get(name)
        if pooled is not None and pooled.tensor.dtype == dtype and pooled.tensor.numel() >= numel:
            return pooled.tensor.view(-1)[:numel].view(shape)
        if pooled is not None:
            self._free(name)
        self._check_heap(name, numel * torch.empty((), dtype=dtype).element_size())
        import nvshmem.core
        import nvshmem.core.interop.torch as nvshmem_torch

        try:
            tensor = nvshmem_torch.tensor((max(numel, 1),), dtype=dtype)
        except nvshmem.core.NvshmemError as error:
            raise MemoryError(_heap_message(name, numel, dtype)) from error
        tensor.zero_()
        peer_views, addresses = [], []
        for pe in range(self.world_size):
            if pe == self.rank:  # nvshmem4py warns against a peer view of one's own buffer
                addresses.append(tensor.data_ptr())
                continue
            view = nvshmem_torch.get_peer_tensor(tensor, pe)
            peer_views.append(view)
            addresses.append(view.data_ptr())
        peer_addresses_W = torch.tensor(addresses, dtype=torch.int64, device=self.device)
        self._buffers[name] = _Buffer(tensor, peer_views, peer_addresses_W)
        self.generation += 1
        # every rank's copy is zeroed before any peer may write into it
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.process_group)
        return tensor.view(-1)[:numel].view(shape)

    def peer_addresses(self, name: str) -> torch.Tensor:
        """int64 [W] device tensor: each PE's copy of buffer `name` as this rank addresses it."""
        return self._buffers[name].peer_addresses_W

    def _check_heap(self, name: str, nbytes: int) -> None:
        heap = symmetric_heap_bytes()
        # NVSHMEM keeps part of the heap for itself: leave a margin
        if self.allocated_bytes + nbytes > heap * 0.95:
            raise MemoryError(
                f"symmetric buffer {name!r} needs {nbytes / 2**20:.1f} MiB on top of "
                f"{self.allocated_bytes / 2**20:.1f} MiB already allocated, beyond the symmetric "
                f"heap of {heap / 2**20:.0f} MiB per rank; raise NVSHMEM_SYMMETRIC_SIZE (e.g. "
                f"NVSHMEM_SYMMETRIC_SIZE={_suggested_size(self.allocated_bytes + nbytes)}) before "
                f"the first MegaMoE forward, or lower max_tokens_per_rank / capacity"
            )

    def _free(self, name: str) -> None:
        import nvshmem.core.interop.torch as nvshmem_torch

        pooled = self._buffers.pop(name)
        torch.cuda.synchronize(self.device)
        pooled.peer_views.clear()
        nvshmem_torch.free_tensor(pooled.tensor)

    def release(self) -> None:
        """Frees every buffer (collective, in the same order on every rank)."""
        for name in sorted(self._buffers):
            self._free(name)


def _heap_message(name: str, numel: int, dtype: torch.dtype) -> str:
    return (
        f"NVSHMEM could not allocate symmetric buffer {name!r} ({numel} x {dtype}); raise "
        f"NVSHMEM_SYMMETRIC_SIZE (now {symmetric_heap_bytes() / 2**20:.0f} MiB per rank)"
    )


def _suggested_size(nbytes: int) -> str:
    return f"{max(1, -(-int(nbytes * 1.25) // (1 << 30)))}G"


_workspaces: dict[tuple[int, str], SymmetricWorkspace] = {}
_nvshmem_group: list = []  # [(group, device)] once NVSHMEM is initialised


def _initialise_nvshmem(process_group: dist.ProcessGroup | None, device: torch.device) -> None:
    import nvshmem.core

    try:
        from cuda.core import Device
    except ImportError:  # cuda-core < 1.0
        from cuda.core.experimental import Device

    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    uid = nvshmem.core.get_unique_id(empty=rank != 0)
    uid_bytes = uid._data.view("int8")
    backend = dist.get_backend(process_group)
    carrier = torch.from_numpy(uid_bytes.copy()).to(device if backend == "nccl" else "cpu")
    dist.broadcast(carrier, group_src=0, group=process_group)
    uid_bytes[:] = carrier.cpu().numpy()
    cuda_device = Device(device.index)
    cuda_device.set_current()
    nvshmem.core.init(
        device=cuda_device, uid=uid, rank=rank, nranks=world, initializer_method="uid"
    )
    _nvshmem_group.append((process_group, device))
    atexit.register(release_all_workspaces)


def workspace_for(
    process_group: dist.ProcessGroup | None, device: torch.device, *, pool: str = "default"
) -> SymmetricWorkspace:
    """The process's symmetric workspace on `process_group` (initialising NVSHMEM on first use).
    Layers share the "default" pool; another `pool` name gets buffers of its own."""
    device = torch.device(device)
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"symmetric workspaces live on a CUDA device with an index, got {device}")
    if not _nvshmem_group:
        _initialise_nvshmem(process_group, device)
    group, nvshmem_device = _nvshmem_group[0]
    if group is not process_group and dist.get_world_size(group) != dist.get_world_size(
        process_group
    ):
        raise ValueError(
            "NVSHMEM is already initialised on another process group; a process runs one "
            "NVSHMEM job, so every expert-parallel layer must use the same group"
        )
    if device != nvshmem_device:
        raise ValueError(f"NVSHMEM is bound to {nvshmem_device}; the layer is on {device}")
    key = (id(group), pool)
    if key not in _workspaces:
        _workspaces[key] = SymmetricWorkspace(
            process_group=group,
            device=device,
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
        )
    return _workspaces[key]


def release_all_workspaces() -> None:
    """Frees every pooled symmetric buffer and finalises NVSHMEM (collective; idempotent)."""
    if not _nvshmem_group:
        return
    import nvshmem.core

    for workspace in _workspaces.values():
        workspace.release()
    _workspaces.clear()
    _nvshmem_group.clear()
    nvshmem.core.finalize()
