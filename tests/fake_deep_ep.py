"""A torch.distributed stand-in for the parts of DeepEP's buffers that megamoe's adapter calls.

Test tree only, never the library. Written from DeepEP's documented behaviour: the docstrings
of deep_ep/buffers/legacy.py (`Buffer`, the V1 API, the same in v1.2.1 and 2.1.0) and
deep_ep/buffers/elastic.py (`ElasticBuffer`, `EPHandle`, V2), docs/legacy.md, README.md, the
host checks of csrc/legacy/buffer.hpp and config.hpp, and its tests (tests/legacy/
test_intranode.py, test_low_latency.py, tests/elastic/test_ep.py, deep_ep/utils/refs.py), at
DeepEP commit dd758caf451848bd150e1046af3d0a73e5fff38d (2.1.0). Every exchange is a
torch.distributed collective on the buffer's group (gloo on a CPU included), so the adapter's
contract runs without GPUs and without DeepEP.

What it reproduces, because the adapter relies on it:
- V1 normal mode. get_dispatch_layout: tokens per rank, None per RDMA rank (one host), tokens
  per expert, is_token_in_rank. dispatch: each token once to every rank owning one of its
  experts, received source rank by source rank in token order; top-k ids made local there (-1
  elsewhere, with weight 0); the host list of received rows per local expert; a handle with
  which `dispatch(x, handle=...)` (cached, no top-k) sends new rows along the same layout.
  combine: the rows a token's ranks send back, summed in rank order in fp32 from zero, rounded
  once to bf16.
- V1 low-latency mode. low_latency_dispatch: a token once per selected expert into
  [L, W x T, H], each expert's rows from the start of its stride in arrival order (the source
  blocks and the tokens inside them in an arbitrary order that changes between calls), the rest
  of the stride garbage (NaN); counts [L] on the device; with use_fp8, DeepEP's recipe (amax
  per 128 channels, at least 1e-4, scale amax / 448) and float32 scales [L, S, G] column-major
  in their last two dims; the handle (source info, layout ranges, max tokens, hidden,
  experts). low_latency_combine: per token, over k in k order, weight x row in fp32 (each
  product rounded, then added), rounded to bf16. A low-latency kernel after normal-mode kernels
  on the same buffer needs clean_low_latency_buffer first.
- V2 ElasticBuffer, non-expanded: dispatch as V1's but the receive order is arbitrary unless
  the buffer is deterministic, the received weights are the source's as they were; an EPHandle
  (num_recv_tokens_per_expert_list, topk_idx, ...) that a cached dispatch takes; combine adds
  the ranks' rows in the order refs.combine uses (each rank's partial at its last top-k slot).
- Events. With async_finish / async_with_compute_stream the outputs are not written (NaN, -1,
  True) until the returned event is waited on or handed to a later call as previous_event (the
  communication stream waits for it): an adapter that reads them early gets garbage.
  Without async, the returned EventOverlap holds no event and waiting on it asserts.
- DeepEP's host checks the adapter could trip: dtypes and contiguity, allocate_on_comm_stream
  without previous_event and async, a cached dispatch given top-k, more tokens than the
  low-latency buffer was sized for, hidden sizes and W x T multiples, the buffer sizes (V1 from
  DeepEP's formulas; V2 from a formula of this file's own, DeepEP's being in its C++).

What it does not: kernels, streams, NVLink or RDMA, timeouts, internode forwarding, expert
alignment other than 1, num_worst_tokens, receive hooks, LogFMT, rank masking, the V2
expanded layout.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

NUM_MAX_NVL_PEERS = 8
BUFFER_ALIGNMENT = 128
TOPK_IDX_DTYPE = torch.int64  # deep_ep.topk_idx_t of a default build
SCALE_GROUP = 128
FP8_MAX = 448.0
ELASTIC_ALIGNMENT = 2 << 20
# a peer that never joins an exchange fails the test on this rank instead of hanging it
TIMEOUT = timedelta(seconds=60)


def wait_for_peers(work, what: str, group) -> None:
    try:
        work.wait(timeout=TIMEOUT)
    except RuntimeError as failure:
        raise RuntimeError(
            f"fake DeepEP rank {dist.get_rank(group)}: {what} waited {TIMEOUT} for its peers"
        ) from failure


class Config:
    """deep_ep.Config: SMs and chunk sizes, and the NVLink / RDMA bytes they need."""

    def __init__(self, num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv):
        assert num_sms >= 0 and 0 < nvl_send < nvl_recv and rdma_send > 0
        self.num_sms = num_sms
        self.num_max_nvl_chunked_recv_tokens = nvl_recv
        self.num_max_rdma_chunked_recv_tokens = -(-rdma_recv // rdma_send) * rdma_send
        assert rdma_send <= self.num_max_rdma_chunked_recv_tokens // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        channels, tokens = self.num_sms // 2, self.num_max_nvl_chunked_recv_tokens
        per_slot = hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4  # row, source meta, top-k, scales
        size = channels * nvl_ranks * ((2 * rdma_ranks + 3) * 4 + tokens * per_slot)
        return -(-size // 128) * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        rdma_ranks, channels = num_ranks // NUM_MAX_NVL_PEERS, self.num_sms // 2
        tokens = self.num_max_rdma_chunked_recv_tokens
        per_slot = (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16) * 2
        size = channels * rdma_ranks * ((NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4 + tokens * per_slot)
        return -(-size // 128) * 128


class EventHandle:
    """An event captured on the current stream (nothing to wait for here)."""


class EventOverlap:
    """deep_ep.EventOverlap: `current_stream_wait()` makes the call's outputs visible."""

    def __init__(self, event=None, pending=None):
        self.event = event
        self._pending = pending

    def current_stream_wait(self) -> None:
        assert self.event is not None  # as DeepEP: a call without async has no event
        self.complete()

    def complete(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending()


def _enter_comm_stream(previous_event, asynchronous: bool, allocate_on_comm_stream: bool) -> None:
    """V1's rule for a call's events (allocate_on_comm_stream needs previous_event and async),
    then the communication stream waits for `previous_event`: what it guards is visible."""
    if allocate_on_comm_stream:
        assert previous_event is not None and asynchronous, (
            "allocate_on_comm_stream needs previous_event and async"
        )
    if isinstance(previous_event, EventOverlap):
        previous_event.complete()


def _check_v2_events(previous_event, allocate_on_comm_stream: bool) -> None:
    """V2's rule for a call's events (previous_event needs allocate_on_comm_stream)."""
    if previous_event is not None:
        assert allocate_on_comm_stream, "previous_event needs allocate_on_comm_stream"


def _deliver(results: tuple, asynchronous: bool) -> tuple[tuple, EventOverlap]:
    """The outputs as the caller sees them: complete, or not yet written until the event."""
    if not asynchronous:
        return results, EventOverlap()
    shown = tuple(_unwritten_like(t) for t in results)

    def write() -> None:
        for target, value in zip(shown, results, strict=True):
            if isinstance(target, torch.Tensor):
                target.copy_(value)

    return shown, EventOverlap(EventHandle(), write)


def _unwritten_like(value):
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype == torch.bool:
        return torch.ones_like(value)
    if value.dtype.is_floating_point:
        return torch.full_like(value, float("nan"))
    return torch.full_like(value, -1)


def _exchange(group, tensors_per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """all_to_all of several row-aligned tensors: tensors_per_rank[r] goes to rank r; returns the
    received tensors, source rank by source rank. FP8 travels as its bytes."""
    world = dist.get_world_size(group)
    counts = torch.tensor([parts[0].shape[0] for parts in tensors_per_rank], dtype=torch.int64)
    received_counts = torch.empty_like(counts)
    wait_for_peers(
        dist.all_to_all_single(received_counts, counts, group=group, async_op=True),
        "the exchange of counts",
        group,
    )
    send_sizes, receive_sizes = counts.tolist(), received_counts.tolist()
    received = []
    for column in range(len(tensors_per_rank[0])):
        send = torch.cat([tensors_per_rank[r][column] for r in range(world)])
        wire = send.view(torch.uint8) if send.dtype == torch.float8_e4m3fn else send
        out = wire.new_empty((sum(receive_sizes), *wire.shape[1:]))
        work = dist.all_to_all_single(
            out, wire.contiguous(), receive_sizes, send_sizes, group=group, async_op=True
        )
        wait_for_peers(work, "the exchange of rows", group)
        received.append(out.view(send.dtype) if send.dtype == torch.float8_e4m3fn else out)
    received.append(torch.tensor(receive_sizes, dtype=torch.int64))
    return received


def _owner_ranks(topk_idx: torch.Tensor, local: int, world: int):
    """The rank owning each top-k expert (-1 where none), and is_token_in_rank [T, W]."""
    owner = torch.where(topk_idx >= 0, topk_idx // local, -1)
    return owner, torch.stack([(owner == rank).any(dim=1) for rank in range(world)], dim=1)


def _local_ids(topk_idx: torch.Tensor, rank: int, local: int) -> torch.Tensor:
    first = rank * local
    mine = (topk_idx >= first) & (topk_idx < first + local)
    return torch.where(mine, topk_idx - first, -1)


def _cast_to_fp8(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's low-latency FP8 cast: per 128 channels, amax (>= 1e-4) / 448."""
    tokens, hidden = x_TH.shape
    grouped = x_TH.float().view(tokens, hidden // SCALE_GROUP, SCALE_GROUP)
    amax = grouped.abs().amax(dim=2).clamp(min=1e-4)
    values = (grouped * (FP8_MAX / amax).unsqueeze(2)).to(torch.float8_e4m3fn)
    return values.view(tokens, hidden), amax / FP8_MAX


class _NormalExchange:
    """What one normal-mode dispatch decided, reused by its cached dispatches and combine."""

    def __init__(self, *, group, is_token_in_rank, receive_order, received_sources):
        self.group = group
        self.is_token_in_rank = is_token_in_rank  # [T, W] bool
        # received token r (as the caller sees them) is exchanged row receive_order[r]
        self.receive_order = receive_order
        self.received_sources = received_sources  # (source rank, source token) per exchanged row

    def send(self, x, x_scales=None):
        world = self.is_token_in_rank.shape[1]
        parts = []
        for rank in range(world):
            tokens = self.is_token_in_rank[:, rank].nonzero().flatten()
            row = [x.index_select(0, tokens)]
            if x_scales is not None:
                row.append(x_scales.index_select(0, tokens).contiguous())
            parts.append(row)
        received = _exchange(self.group, parts)[:-1]
        return [t.index_select(0, self.receive_order) for t in received]

    def combine(self, x_RH: torch.Tensor, rank_order_TW: torch.Tensor | None = None):
        """Sends each received row home; each token adds its ranks' rows in fp32 from zero (in
        rank order, or in the order rank_order_TW[t] lists them, -1 past its last) and rounds
        once to x's dtype."""
        tokens_count, world = self.is_token_in_rank.shape
        exchanged = torch.empty_like(x_RH)
        exchanged[self.receive_order] = x_RH
        sources = self.received_sources
        parts = []
        for rank in range(world):
            rows = (sources[:, 0] == rank).nonzero().flatten()
            parts.append([exchanged.index_select(0, rows), sources[rows, 1]])
        returned, tokens, sizes = _exchange(self.group, parts)
        row_of_TW = torch.full((tokens_count, world), -1, dtype=torch.int64)
        row_of_TW[tokens, torch.repeat_interleave(torch.arange(world), sizes)] = torch.arange(
            returned.shape[0]
        )
        if rank_order_TW is None:
            rank_order_TW = torch.arange(world).expand(tokens_count, world)
        y_TH = torch.zeros(tokens_count, x_RH.shape[1], dtype=torch.float32)
        for position in range(world):
            rank = rank_order_TW[:, position]
            row = row_of_TW.gather(1, rank.clamp(min=0)[:, None]).squeeze(1)
            arrived = (rank >= 0) & (row >= 0)
            # adding +0.0 where nothing arrived leaves every fp32 sum as it is
            y_TH += torch.where(arrived[:, None], returned[row.clamp(min=0)].float(), 0.0)
        return y_TH.to(x_RH.dtype)


def _normal_dispatch(
    group,
    x,
    x_scales,
    topk_idx,
    topk_weights,
    is_token_in_rank,
    num_experts,
    *,
    shuffle_generator=None,
    mask_weights=True,
):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local = num_experts // world
    sources_T2 = torch.stack(
        [torch.full((x.shape[0],), rank, dtype=torch.int64), torch.arange(x.shape[0])], dim=1
    )
    parts = []
    for dst in range(world):
        tokens = is_token_in_rank[:, dst].nonzero().flatten()
        ids = _local_ids(topk_idx.index_select(0, tokens), dst, local)
        weights = topk_weights.index_select(0, tokens)
        if mask_weights:
            weights = torch.where(ids >= 0, weights, 0.0)
        row = [x.index_select(0, tokens), ids, weights, sources_T2.index_select(0, tokens)]
        if x_scales is not None:
            row.append(x_scales.index_select(0, tokens).contiguous())
        parts.append(row)
    received = _exchange(group, parts)
    recv_x, recv_idx, recv_weights, sources = received[:4]
    recv_scales = received[4] if x_scales is not None else None
    rows = recv_x.shape[0]
    order = (
        torch.arange(rows)
        if shuffle_generator is None
        else torch.randperm(rows, generator=shuffle_generator)
    )
    exchange = _NormalExchange(
        group=group,
        is_token_in_rank=is_token_in_rank,
        receive_order=order,
        received_sources=sources,
    )
    recv_idx, recv_weights = recv_idx[order], recv_weights[order]
    recv_x = recv_x[order]
    recv_scales = None if recv_scales is None else recv_scales[order]
    counts = [int((recv_idx == e).sum()) for e in range(local)]
    return recv_x, recv_scales, recv_idx, recv_weights, counts, exchange


def _check_bf16_rows(x, dims: int = 2) -> None:
    """What DeepEP's combines and low-latency dispatch take: contiguous bf16 of `dims` dims."""
    assert x.dim() == dims and x.is_contiguous() and x.dtype == torch.bfloat16


def _check_topk(topk_idx, *topk_weights, contiguous: bool = True) -> None:
    """Top-k ids of deep_ep.topk_idx_t and, where the call takes them, float32 weights;
    contiguous where the call needs it (V1; V2's host checks ask only the dtypes)."""
    checks = [(topk_idx, TOPK_IDX_DTYPE)] + [(weights, torch.float32) for weights in topk_weights]
    for tensor, dtype in checks:
        assert tensor.dtype == dtype and (tensor.is_contiguous() or not contiguous)


def _check_combine_call(x, bias) -> None:
    """The host checks V1's and V2's normal-mode combines share."""
    assert bias is None, "not in this stand-in"
    _check_bf16_rows(x)


def _normal_combine(exchange, x, asynchronous: bool, rank_order_TW=None):
    """V1's and V2's normal-mode combine once their own checks ran: the received rows of
    `exchange` sent home and added there (see _NormalExchange.combine)."""
    assert x.shape[0] == exchange.receive_order.numel()
    (combined,), event = _deliver((exchange.combine(x, rank_order_TW),), asynchronous)
    return combined, None, event


def _cached_dispatch(exchange, x, x_scales, asynchronous: bool) -> tuple[tuple, EventOverlap]:
    """New rows along the layout of an earlier dispatch (a handle's exchange), no top-k."""
    return _deliver(tuple(exchange.send(x, x_scales)), asynchronous)


def _check_tokens(x, x_scales):
    assert x.dim() == 2 and x.is_contiguous()
    assert x.shape[1] * x.element_size() % 16 == 0
    if x_scales is not None:
        assert x.element_size() == 1 and x_scales.dtype == torch.float32
        assert x_scales.dim() == 2 and x_scales.shape[0] == x.shape[0]
    else:
        assert x.dtype == torch.bfloat16, "DeepEP dispatches bf16 (or FP8 with scales)"


# DeepEP's tuned Configs per EP size (after Buffer.num_sms): NVLink send and receive chunks,
# RDMA send and receive chunks
DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
}
COMBINE_CONFIGS = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
}


def _tuned_config(table: dict[int, tuple[int, ...]], num_ranks: int) -> Config:
    assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks}"
    return Config(Buffer.num_sms, *table[num_ranks])


class Buffer:
    """deep_ep.Buffer (V1): intranode normal mode and the low-latency mode."""

    num_sms = 20

    def __init__(
        self,
        group,
        num_nvl_bytes=0,
        num_rdma_bytes=0,
        low_latency_mode=False,
        num_qps_per_rank=24,
        **_options,
    ):
        assert num_nvl_bytes % BUFFER_ALIGNMENT == 0 and num_rdma_bytes % BUFFER_ALIGNMENT == 0
        self.group = group
        self.rank, self.group_size = group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self._low_latency_clean = True
        self._arrivals = torch.Generator().manual_seed(1000 + self.rank)
        # what a test reads to see which DeepEP calls ran
        self.calls: list[str] = []

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return _tuned_config(DISPATCH_CONFIGS, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return _tuned_config(COMBINE_CONFIGS, num_ranks)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        max_tokens: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        scales = hidden // SCALE_GROUP
        dispatch_message = 16 + max(hidden * 2, hidden + scales * 4)
        combine_message = scales * 4 + hidden * 2
        send = max(max_tokens * dispatch_message, num_experts * max_tokens * combine_message)
        receive = num_experts * max_tokens * max(dispatch_message, combine_message)
        signals = -(-num_experts * 4 // 128) * 128
        total = 2 * (send + receive + signals)
        return (total + BUFFER_ALIGNMENT) // BUFFER_ALIGNMENT * BUFFER_ALIGNMENT

    def _normal_kernels_ran(self, config: Config | None, hidden_bytes: int, combine: bool):
        config = config or (
            self.get_combine_config(self.group_size)
            if combine
            else self.get_dispatch_config(self.group_size)
        )
        assert config.get_nvl_buffer_size_hint(hidden_bytes, self.group_size) <= self.num_nvl_bytes
        if self.low_latency_mode:
            self._low_latency_clean = False

    def get_dispatch_layout(
        self,
        topk_idx,
        num_experts,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        self.calls.append("get_dispatch_layout")
        assert topk_idx.dim() == 2
        _check_topk(topk_idx)
        _enter_comm_stream(previous_event, async_finish, allocate_on_comm_stream)
        world, local = self.group_size, num_experts // self.group_size
        _, is_token_in_rank = _owner_ranks(topk_idx, local, world)
        per_rank = is_token_in_rank.sum(dim=0).to(torch.int32)
        per_expert = torch.stack([(topk_idx == e).sum() for e in range(num_experts)]).to(
            torch.int32
        )
        (per_rank, per_expert, is_token_in_rank), event = _deliver(
            (per_rank, per_expert, is_token_in_rank), async_finish
        )
        return per_rank, None, per_expert, is_token_in_rank, event

    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment=1,
        num_worst_tokens=0,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        self.calls.append("dispatch" if handle is None else "cached_dispatch")
        assert expert_alignment == 1 and num_worst_tokens == 0, "not in this stand-in"
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        _check_tokens(x, x_scales)
        _enter_comm_stream(previous_event, async_finish, allocate_on_comm_stream)
        self._normal_kernels_ran(config, x.shape[1] * max(x.element_size(), 2), combine=False)
        if handle is not None:
            assert topk_idx is None and topk_weights is None, "a cached dispatch takes no top-k"
            shown, event = _cached_dispatch(handle[5], x, x_scales, async_finish)
            return (shown if x_scales is not None else shown[0]), None, None, None, None, event
        assert num_tokens_per_rank is not None and is_token_in_rank is not None
        assert num_tokens_per_expert is not None and num_tokens_per_rank.dtype == torch.int32
        assert is_token_in_rank.dtype == torch.bool and is_token_in_rank.shape[0] == x.shape[0]
        _check_topk(topk_idx, topk_weights)
        num_experts = num_tokens_per_expert.numel()
        recv_x, recv_scales, recv_idx, recv_weights, counts, exchange = _normal_dispatch(
            self.group, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_experts
        )
        received_per_rank = torch.bincount(
            exchange.received_sources[:, 0], minlength=self.group_size
        )
        prefix = torch.zeros(self.group_size, self.group_size, dtype=torch.int32)
        prefix[:, self.rank] = received_per_rank.cumsum(0).to(torch.int32)
        handle = (
            prefix,
            None,
            None,
            exchange.received_sources[:, 1].to(torch.int32),
            is_token_in_rank,
            exchange,
        )
        outputs = (
            (recv_x, recv_idx, recv_weights)
            if recv_scales is None
            else (recv_x, recv_scales, recv_idx, recv_weights)
        )
        shown, event = _deliver(outputs, async_finish)
        if recv_scales is None:
            recv_x, recv_idx, recv_weights = shown
        else:
            recv_x, recv_scales, recv_idx, recv_weights = shown
            recv_x = (recv_x, recv_scales)
        return recv_x, recv_idx, recv_weights, counts, handle, event

    def combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        self.calls.append("combine")
        _check_combine_call(x, bias)
        _enter_comm_stream(previous_event, async_finish, allocate_on_comm_stream)
        self._normal_kernels_ran(config, x.shape[1] * 2, combine=True)
        return _normal_combine(handle[5], x, async_finish)

    def clean_low_latency_buffer(self, max_tokens, hidden, num_experts) -> None:
        self.calls.append("clean_low_latency_buffer")
        wait_for_peers(
            dist.barrier(group=self.group, async_op=True), "the clean's barrier", self.group
        )
        self._low_latency_clean = True

    def low_latency_dispatch(
        self,
        x,
        topk_idx,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        cumulative_local_expert_recv_stats=None,
        dispatch_wait_recv_cost_stats=None,
        use_fp8=True,
        round_scale=False,
        use_ue8m0=False,
        async_finish=False,
        return_recv_hook=False,
    ):
        self.calls.append("low_latency_dispatch")
        max_tokens, world = num_max_dispatch_tokens_per_rank, self.group_size
        assert self.low_latency_mode
        assert self._low_latency_clean, "run clean_low_latency_buffer after normal-mode kernels"
        _check_bf16_rows(x)
        assert x.shape[1] % 128 == 0 and x.shape[0] <= max_tokens
        _check_topk(topk_idx)
        assert num_experts % world == 0 and world * max_tokens % 4 == 0
        assert not use_fp8 or x.shape[1] % 512 == 0
        assert not (round_scale or use_ue8m0 or return_recv_hook), "not in this stand-in"
        hidden = x.shape[1]
        needed = self.get_low_latency_rdma_size_hint(max_tokens, hidden, world, num_experts)
        assert needed <= self.num_rdma_bytes
        local, stride = num_experts // world, world * max_tokens
        rows, scales = _cast_to_fp8(x) if use_fp8 else (x, None)
        tokens_K, slots_K = torch.nonzero(topk_idx >= 0, as_tuple=True)
        experts = topk_idx[tokens_K, slots_K]
        parts = []
        for dst in range(world):
            mine = (experts // local) == dst
            row = [rows[tokens_K[mine]], experts[mine] - dst * local, tokens_K[mine]]
            if use_fp8:
                row.append(scales[tokens_K[mine]])
            parts.append(row)
        received = _exchange(self.group, parts)
        recv_rows, recv_expert, recv_token, sizes = (*received[:3], received[-1])
        recv_source = torch.repeat_interleave(torch.arange(world), sizes)
        # rows past each count: whatever the buffer last held (NaN here)
        if use_fp8:
            packed = torch.full((local, stride, hidden), float("nan")).to(torch.float8_e4m3fn)
            packed_scales = torch.full((local, hidden // SCALE_GROUP, stride), float("nan"))
        else:
            packed = torch.full((local, stride, hidden), float("nan"), dtype=torch.bfloat16)
        src_info = torch.full((local, stride), -1, dtype=torch.int32)
        layout_range = torch.zeros(local, world, dtype=torch.int64)
        counts = torch.zeros(local, dtype=torch.int32)
        for expert in range(local):
            begin = 0
            for source in torch.randperm(world, generator=self._arrivals).tolist():
                arrived = ((recv_expert == expert) & (recv_source == source)).nonzero().flatten()
                arrived = arrived[torch.randperm(arrived.numel(), generator=self._arrivals)]
                slots = slice(begin, begin + arrived.numel())
                packed[expert, slots] = recv_rows[arrived]
                if use_fp8:
                    packed_scales[expert, :, slots] = received[3][arrived].t()
                src_info[expert, slots] = recv_token[arrived].to(torch.int32)
                layout_range[expert, source] = (begin << 32) | arrived.numel()
                begin += arrived.numel()
            counts[expert] = begin
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += counts
        handle = (src_info, layout_range, max_tokens, hidden, num_experts)
        outputs = (packed, packed_scales, counts) if use_fp8 else (packed, counts)
        shown, event = _deliver(outputs, async_finish)
        recv = (shown[0], shown[1].transpose(1, 2)) if use_fp8 else shown[0]
        return recv, shown[-1], handle, event, None

    def low_latency_combine(
        self,
        x,
        topk_idx,
        topk_weights,
        handle,
        use_logfmt=False,
        zero_copy=False,
        async_finish=False,
        return_recv_hook=False,
        out=None,
        combine_wait_recv_cost_stats=None,
    ):
        self.calls.append("low_latency_combine")
        src_info, layout_range, max_tokens, hidden, num_experts = handle
        world, local = self.group_size, num_experts // self.group_size
        assert self.low_latency_mode and self._low_latency_clean
        _check_bf16_rows(x, dims=3)
        assert tuple(x.shape) == (local, world * max_tokens, hidden)
        _check_topk(topk_idx, topk_weights)
        assert topk_weights.shape == topk_idx.shape and topk_idx.shape[0] <= max_tokens
        assert not (use_logfmt or zero_copy or return_recv_hook), "not in this stand-in"
        parts = []
        for source in range(world):
            rows, experts, tokens = [], [], []
            for expert in range(local):
                begin, count = (
                    int(layout_range[expert, source]) >> 32,
                    int(layout_range[expert, source]) & 0xFFFFFFFF,
                )
                rows.append(x[expert, begin : begin + count])
                experts.append(torch.full((count,), self.rank * local + expert))
                tokens.append(src_info[expert, begin : begin + count].long())
            parts.append([torch.cat(rows), torch.cat(experts), torch.cat(tokens)])
        returned, experts, tokens, _ = _exchange(self.group, parts)
        row_of = {(int(t), int(e)): i for i, (t, e) in enumerate(zip(tokens, experts, strict=True))}
        combined = torch.zeros(topk_idx.shape[0], hidden, dtype=torch.float32)
        for t in range(topk_idx.shape[0]):
            for k in range(topk_idx.shape[1]):
                expert = int(topk_idx[t, k])
                if expert >= 0:
                    product = returned[row_of[(t, expert)]].float() * topk_weights[t, k]
                    combined[t] += product
        combined = combined.to(torch.bfloat16)
        if out is not None:
            out.copy_(combined)
            combined = out
        (combined,), event = _deliver((combined,), async_finish)
        return combined, event, None


class EPHandle:
    """deep_ep.EPHandle (non-expanded): what a cached dispatch and a combine read."""

    def __init__(
        self, *, num_experts, num_max_tokens_per_rank, topk_idx, counts, exchange, rank_order
    ):
        self.do_expand = False
        self.num_experts = num_experts
        self.expert_alignment = 1
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.topk_idx = topk_idx
        self.num_recv_tokens_per_expert_list = counts
        self.num_recv_tokens = exchange.receive_order.numel()
        self.exchange = exchange
        self.rank_order = rank_order


class ElasticBuffer:
    """deep_ep.ElasticBuffer (V2): the non-expanded dispatch and its combine."""

    def __init__(
        self,
        group,
        num_bytes=None,
        num_cpu_bytes=0,
        num_max_tokens_per_rank=0,
        hidden=0,
        num_topk=0,
        use_fp8_dispatch=False,
        deterministic=False,
        allow_hybrid_mode=True,
        allow_multiple_reduction=True,
        **_options,
    ):
        self.group = group
        self.rank_idx, self.num_ranks = group.rank(), group.size()
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        if num_bytes is None:
            num_bytes = self.get_buffer_size_hint(
                group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch
            )
        assert num_bytes % ELASTIC_ALIGNMENT == 0
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self._arrivals = torch.Generator().manual_seed(2000 + self.rank_idx)
        self.calls: list[str] = []

    @staticmethod
    def get_buffer_size_hint(
        group,
        num_max_tokens_per_rank,
        hidden,
        num_topk=0,
        use_fp8_dispatch=False,
        allow_hybrid_mode=True,
        allow_multiple_reduction=True,
    ) -> int:
        # this stand-in's own formula (DeepEP's is computed in its C++): receive space for
        # every rank's tokens, with their top-k ids and weights, twice
        per_token = hidden * (1 if use_fp8_dispatch else 2) + max(num_topk, 1) * 12
        size = 2 * group.size() * num_max_tokens_per_rank * per_token
        return max(1, -(-size // ELASTIC_ALIGNMENT)) * ELASTIC_ALIGNMENT

    @staticmethod
    def capture() -> EventHandle:
        return EventHandle()

    def dispatch(
        self,
        x,
        topk_idx=None,
        topk_weights=None,
        cumulative_local_expert_recv_stats=None,
        num_experts=None,
        num_max_tokens_per_rank=None,
        expert_alignment=None,
        num_sms=0,
        num_qps=0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream=False,
        allocate_on_comm_stream=False,
        handle=None,
        do_handle_copy=True,
        do_cpu_sync=None,
        do_expand=False,
        do_zero_padding=False,
        use_tma_aligned_col_major_sf=False,
    ):
        self.calls.append("dispatch" if handle is None else "cached_dispatch")
        assert not do_expand and expert_alignment in (None, 1), "not in this stand-in"
        assert isinstance(x, torch.Tensor), "not in this stand-in: FP8 on V2"
        _check_tokens(x, None)
        _check_v2_events(previous_event, allocate_on_comm_stream)
        if handle is not None:
            assert topk_idx is None and not do_cpu_sync
            (recv_x,), event = _cached_dispatch(handle.exchange, x, None, async_with_compute_stream)
            return recv_x, None, None, handle, event
        max_tokens = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        assert x.shape[0] <= max_tokens and num_experts is not None
        assert do_cpu_sync in (None, True), "not in this stand-in: no-sync mode"
        _check_topk(topk_idx, topk_weights, contiguous=False)
        needed = self.get_buffer_size_hint(self.group, max_tokens, x.shape[1], topk_idx.shape[1])
        assert needed <= self.num_bytes
        local = num_experts // self.num_ranks
        owner, is_token_in_rank = _owner_ranks(topk_idx, local, self.num_ranks)
        recv_x, _, recv_idx, recv_weights, counts, exchange = _normal_dispatch(
            self.group,
            x,
            None,
            topk_idx,
            topk_weights,
            is_token_in_rank,
            num_experts,
            shuffle_generator=None if self.deterministic else self._arrivals,
            mask_weights=False,
        )
        # refs.combine: each rank's partial sits at its last top-k slot, then slots add in order
        last_slot_TW = torch.full((x.shape[0], self.num_ranks), -1, dtype=torch.int64)
        for k in range(topk_idx.shape[1]):
            present = owner[:, k] >= 0
            last_slot_TW[present.nonzero().flatten(), owner[present, k]] = k
        by_slot = torch.where(last_slot_TW >= 0, last_slot_TW, topk_idx.shape[1])
        ranks_by_slot = torch.argsort(by_slot, dim=1, stable=True)
        rank_order = torch.where(
            by_slot.gather(1, ranks_by_slot) < topk_idx.shape[1], ranks_by_slot, -1
        )
        new_handle = EPHandle(
            num_experts=num_experts,
            num_max_tokens_per_rank=max_tokens,
            topk_idx=topk_idx.clone() if do_handle_copy else topk_idx,
            counts=counts,
            exchange=exchange,
            rank_order=rank_order,
        )
        shown, event = _deliver((recv_x, recv_idx, recv_weights), async_with_compute_stream)
        return (*shown, new_handle, event)

    def combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        num_sms=0,
        num_qps=0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream=False,
        allocate_on_comm_stream=False,
    ):
        self.calls.append("combine")
        _check_combine_call(x, bias)
        _check_v2_events(previous_event, allocate_on_comm_stream)
        assert x.shape[0] == handle.num_recv_tokens
        return _normal_combine(
            handle.exchange, x, async_with_compute_stream, rank_order_TW=handle.rank_order
        )
