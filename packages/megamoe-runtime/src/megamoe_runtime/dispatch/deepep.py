"""Expert parallelism through a DeepEP buffer the caller built and owns: the DeepEP adapter.

Shape legend: T tokens of this rank, K experts per token, H hidden size, E experts in all,
W ranks of the buffer's group, L = E / W experts per rank, R tokens this rank receives (each
once, however many of its experts live here), S = W x max tokens per rank (the stride of a
low-latency expert), G = H / 128 FP8 scale groups.

Serving engines and trainers own a `deep_ep` buffer sized for their cluster (one host over
NVLink, or several over RDMA); `DeepEPDispatcher` puts megamoe's expert compute behind it.
megamoe never imports `deep_ep` and declares no dependency on it: the adapter calls the methods
of the buffer it is given, checked by name at construction. Rank r owns experts
[r x L, (r + 1) x L), as DeepEP and megamoe's other dispatchers both lay them out, so a layer's
weights shard the same way whichever dispatcher carries its tokens.

| buffer | mode | DeepEP calls | batch the experts see | host sync |
|---|---|---|---|---|
| V1 `deep_ep.Buffer` | normal | get_dispatch_layout, dispatch, combine | tight, placed here | one per dispatch (DeepEP's wait for the receive counts); none in `cached_dispatch` |
| V1 `deep_ep.Buffer(low_latency_mode=True)` | low_latency | low_latency_dispatch, low_latency_combine | masked: DeepEP's receive buffer, in place | none (CUDA-graph capturable) |
| V2 `deep_ep.ElasticBuffer` | normal | dispatch (do_cpu_sync, not expanded), combine | tight, placed here | as V1 normal |

Normal mode. DeepEP sends each token once to every rank that owns one of its experts, with the
token's top-k ids made local there (-1 for experts elsewhere) and its weights. The receiver
sorts its (token, k) pairs stably by local expert (`expert_major_order`, the single-GPU
dispatcher's sort: the absent pairs sort past the last expert), gathers one batch row per
pair and knows the batch's size on the host from DeepEP's per-expert receive counts. After the
expert compute it sums each received token's local outputs in k order in fp32, each product
rounded on its own (`weighted_sum_over_topk`, the single-GPU combine's arithmetic), rounds the
partial to bf16 and hands DeepEP one row per received token; DeepEP's combine adds the partials
of the ranks a token went to (V1: in rank order, in fp32, rounded once). That is the
arithmetic of `owner_partials_combine` (dispatch/reference.py): one bf16 rounding more than
the single-GPU layer, so EP=W matches EP=1 within bf16 tolerance, not bitwise.

`cached_dispatch(x, handle)` sends new rows along a previous dispatch's layout (DeepEP's
cached mode: the handle's receive counts and placement are reused, so the host does not wait
for counts). The caller promises the routing is the same; nothing is compared.

Low-latency mode. DeepEP's low_latency_dispatch leaves every local expert's received rows at
the start of its stride in [L, S, H] (bf16, or e4m3 with float32 [L, S, G] scales with
`fp8_dispatch`), with the counts [L] on the device; the expert compute reads that buffer in
place as a masked `ExpertBatch` (no copy of the rows; FP8 scales are copied into the batch's
[G, M] layout, 1/32 of the rows' bytes). low_latency_combine takes the outputs in the same
layout and sums each token's k contributions with its weights in k order in fp32 on the
source; its kernel may fuse each multiply into the add, so EP=W matches EP=1 within bf16
tolerance. Nothing waits on the host, so a forward with this dispatcher is capturable in a
CUDA graph (DeepEP's low-latency kernels are). The order of rows inside an expert's stride is
the order of arrival, not fixed; each output row depends only on its own input row, so results
do not depend on it.

Streams. Normal-mode calls follow DeepEP's overlap pattern: an event captured on the caller's
stream (`buffer.capture()`) is DeepEP's `previous_event`, its kernels run on its communication
stream with their outputs allocated there (`allocate_on_comm_stream`), and the caller's stream
waits on the returned event before anything reads them (`async_finish` /
`async_with_compute_stream`): the host never synchronises the device. Low-latency calls run
with async_finish=False and no receive hook: DeepEP orders them on the caller's stream itself.
One V1 buffer may serve a normal-mode and a low-latency dispatcher (prefill and decode): the
first low-latency dispatch after normal-mode kernels ran on it calls DeepEP's
`clean_low_latency_buffer` first, as DeepEP requires.

Waits on other ranks are DeepEP's: its kernels give up after their own timeouts (V1: a cycle
count, with a message naming the kernel; V2: `num_gpu_timeout_secs` / `num_cpu_timeout_secs`).
The adapter adds no wait of its own. Bad input (a buffer of another kind or too small, experts
that do not split over the ranks, more tokens than a low-latency buffer was sized for, a wrong
dtype or shape) raises a ValueError/TypeError naming it before anything is launched.

Not covered: V1 normal mode's `num_worst_tokens` (no host sync, intranode only), V2's expanded
layout, V2's no-sync mode (`do_cpu_sync=False`), FP8 dispatch on a V2 buffer, DeepEP's
receive hooks (`return_recv_hook`) and LogFMT combine.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megamoe_runtime.dispatch.checks import (
    check_expert_ids,
    check_token_count,
    check_top_k,
    experts_per_rank,
    validate_dispatch_inputs,
)
from megamoe_runtime.dispatch.deepep_buffers import (
    check_v1_low_latency_buffer,
    check_v1_normal_buffer,
    check_v2_buffer,
    deepep_api_of,
)
from megamoe_runtime.dispatch.local import expert_major_order, weighted_sum_over_topk
from megamoe_runtime.expert_batch import ExpertBatch

MODES = ("normal", "low_latency")
# the mode each V1 buffer last ran: its low-latency kernels need part of the buffer zeroed
# again after normal-mode kernels used it (DeepEP's clean_low_latency_buffer)
_LAST_MODE_OF_BUFFER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class DeepEPNormalHandle:
    """A normal-mode dispatch's layout (reusable by `cached_dispatch`) and what combine needs."""

    deep_handle: Any  # DeepEP's handle: V1 a tuple, V2 an EPHandle
    tokens: int  # T, this rank's tokens
    received: int  # R
    # batch row b holds received token received_of_row[b] (b < the batch's valid rows)
    received_of_row: torch.Tensor
    expert_offsets: torch.Tensor  # int32 [L + 1]
    # the batch row of each received (token, k), 0 where the expert is not local
    row_of_pair_RK: torch.Tensor
    pair_present_RK: torch.Tensor  # bool: the expert is local
    recv_topk_weights_RK: torch.Tensor  # float32

    @property
    def valid_rows(self) -> int:
        return self.received_of_row.numel()


@dataclass(frozen=True)
class DeepEPLowLatencyHandle:
    """What low_latency_combine needs: DeepEP's handle and the routing the dispatch sent."""

    deep_handle: tuple
    topk_idx_TK: torch.Tensor  # deep_ep.topk_idx_t
    topk_weights_TK: torch.Tensor  # float32
    rows_per_expert: int  # S


class DeepEPDispatcher:
    """Dispatch and combine through a DeepEP buffer (see the module docstring).

    buffer: a `deep_ep.Buffer` (V1; `low_latency_mode=True` for mode='low_latency') or a
      `deep_ep.ElasticBuffer` (V2, mode='normal'), sized by the caller for this layer's
      hidden size (and for low latency, `max_tokens_per_rank` and `num_experts`); its
      torch.distributed group is the layer's expert-parallel group.
    num_experts, top_k, hidden_size: the layer's; the experts must split evenly over the ranks.
    mode: 'normal' (prefill, training: DeepEP's high-throughput kernels, a tight batch) or
      'low_latency' (decode: a masked batch read in place, no host sync).
    max_tokens_per_rank: the most tokens a rank sends per call. Low latency: DeepEP's
      `num_max_dispatch_tokens_per_rank` (required; every rank passes the same). V2: the
      buffer's `num_max_tokens_per_rank` unless given. V1 normal: optional, a bound each call
      is checked against (DeepEP's normal buffers take any count).
    fp8_dispatch: tokens cross the wire as e4m3 with one scale per 128 channels (half the
      bytes) and reach the experts as FP8 rows (V1 only; normal mode quantizes them here with
      megamoe's recipe, low latency with DeepEP's).
    dispatch_config, combine_config: V1 normal mode's `deep_ep.Config`s (None: DeepEP's
      recommended ones for the group size).
    topk_idx_dtype: `deep_ep.topk_idx_t` of the DeepEP build (int64 unless it was built with
      other top-k index bits); the ids are cast to it.
    check_ids: validate expert ids on every dispatch (a host sync).
    """

    def __init__(
        self,
        buffer: Any,
        *,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        mode: str = "normal",
        max_tokens_per_rank: int | None = None,
        fp8_dispatch: bool = False,
        dispatch_config: Any = None,
        combine_config: Any = None,
        topk_idx_dtype: torch.dtype = torch.int64,
        check_ids: bool = False,
    ):
        self.api = deepep_api_of(buffer)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        for name, value in (("top_k", top_k), ("hidden_size", hidden_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        group = buffer.group
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"the buffer's group must be a torch.distributed ProcessGroup (a buffer built from "
                f"an mpi4py communicator has none), got {type(group).__name__}"
            )
        if self.api == "v1":
            rank, world = buffer.rank, buffer.group_size
        else:
            rank, world = buffer.rank_idx, buffer.num_ranks
        if (dist.get_rank(group), dist.get_world_size(group)) != (rank, world):
            raise ValueError(
                f"the buffer says rank {rank} of {world}, but its group says rank "
                f"{dist.get_rank(group)} of {dist.get_world_size(group)}"
            )
        self.buffer = buffer
        self.mode = mode
        self.rank, self.world_size = rank, world
        self.num_experts = num_experts
        self.num_local_experts = experts_per_rank(num_experts, world)
        self.top_k, self.hidden_size = top_k, hidden_size
        self.fp8_dispatch = fp8_dispatch
        self.topk_idx_dtype = topk_idx_dtype
        self.check_ids = check_ids
        self.dispatch_config = self.combine_config = None
        self.max_tokens_per_rank = max_tokens_per_rank
        sizes = {"hidden_size": hidden_size, "world_size": world, "fp8_dispatch": fp8_dispatch}
        if self.api == "v2":
            self.max_tokens_per_rank = check_v2_buffer(
                buffer, mode=mode, top_k=top_k, max_tokens_per_rank=max_tokens_per_rank, **sizes
            )
        elif mode == "low_latency":
            check_v1_low_latency_buffer(
                buffer, num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank, **sizes
            )
        else:
            self.dispatch_config, self.combine_config = check_v1_normal_buffer(
                buffer, dispatch_config=dispatch_config, combine_config=combine_config, **sizes
            )

    @property
    def masked_batches(self) -> bool:
        """Whether dispatch hands the experts masked batches (low-latency mode)."""
        return self.mode == "low_latency"

    @property
    def fp8_batches(self) -> bool:
        """Whether dispatch hands the experts FP8 rows (fp8_dispatch)."""
        return self.fp8_dispatch

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The buffer's group: the layer's expert-parallel group."""
        return self.buffer.group

    def describe(self) -> str:
        api = "V1 deep_ep.Buffer" if self.api == "v1" else "V2 deep_ep.ElasticBuffer"
        wire = "FP8" if self.fp8_dispatch else "bf16"
        return f"DeepEP {api}, {self.mode.replace('_', '-')} mode, {wire} dispatch"

    # dispatch

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[ExpertBatch, DeepEPNormalHandle | DeepEPLowLatencyHandle]:
        """Sends each token to its experts' ranks; returns this rank's batch (tight in normal
        mode, masked in low-latency mode) and the handle combine needs."""
        topk_idx_TK, weights_TK = self._checked_routing(x_TH, topk_ids_TK, topk_weights_TK)
        if self.mode == "low_latency":
            return self._dispatch_low_latency(x_TH, topk_idx_TK, weights_TK)
        wire = self._wire_tokens(x_TH)
        if self.api == "v1":
            recv, recv_idx, recv_weights, counts, deep_handle = self._dispatch_v1(
                wire, topk_idx_TK, weights_TK
            )
        else:
            recv, recv_idx, recv_weights, counts, deep_handle = self._dispatch_v2(
                wire, topk_idx_TK, weights_TK
            )
        handle = self._place(
            deep_handle,
            tokens=x_TH.shape[0],
            recv_idx_RK=recv_idx,
            recv_weights_RK=recv_weights,
            valid_rows=sum(counts),
        )
        return self._batch(recv, handle), handle

    def cached_dispatch(
        self, x_TH: torch.Tensor, handle: DeepEPNormalHandle
    ) -> tuple[ExpertBatch, DeepEPNormalHandle]:
        """Sends `x_TH` along `handle`'s layout (the same routing as the dispatch that returned
        it): DeepEP's cached dispatch, with no wait for receive counts on the host; the batch is
        placed as that dispatch's was and `handle` serves its combine too."""
        if self.mode != "normal":
            raise ValueError(
                "cached_dispatch reuses a normal-mode layout; low-latency mode has no layout to "
                "cache (it never waits on the host): call dispatch"
            )
        if not isinstance(handle, DeepEPNormalHandle):
            raise TypeError(
                f"handle must come from this dispatcher's dispatch, got {type(handle).__name__}"
            )
        self._check_tokens(x_TH)
        if x_TH.shape[0] != handle.tokens:
            raise ValueError(
                f"x has {x_TH.shape[0]} tokens but the handle's layout was built for "
                f"{handle.tokens}: a cached dispatch sends the same tokens' new rows"
            )
        buffer, wire = self.buffer, self._wire_tokens(x_TH)
        if self.api == "v1":
            _LAST_MODE_OF_BUFFER[buffer] = "normal"
            recv, *_, done = buffer.dispatch(
                wire,
                handle=handle.deep_handle,
                config=self.dispatch_config,
                previous_event=buffer.capture(),
                async_finish=True,
                allocate_on_comm_stream=True,
            )
        else:
            recv, *_, done = buffer.dispatch(
                wire,
                handle=handle.deep_handle,
                previous_event=buffer.capture(),
                async_with_compute_stream=True,
                allocate_on_comm_stream=True,
            )
        done.current_stream_wait()
        return self._batch(recv, handle), handle

    def _check_tokens(self, x_TH: torch.Tensor) -> None:
        if not isinstance(x_TH, torch.Tensor) or x_TH.dim() != 2:
            raise ValueError(
                f"x must be a 2-D [tokens, hidden] tensor, got "
                f"{tuple(x_TH.shape) if isinstance(x_TH, torch.Tensor) else type(x_TH).__name__}"
            )
        if x_TH.shape[1] != self.hidden_size:
            raise ValueError(
                f"x has hidden size {x_TH.shape[1]}; the dispatcher (and its DeepEP buffer) was "
                f"built for {self.hidden_size}"
            )
        if x_TH.dtype != torch.bfloat16:
            raise TypeError(
                f"DeepEP dispatches bf16 tokens (fp8_dispatch=True sends them as FP8), got x of "
                f"dtype {x_TH.dtype}: run the layer in bf16"
            )
        if self.max_tokens_per_rank is not None:
            check_token_count(x_TH.shape[0], self.max_tokens_per_rank, sized="the DeepEP buffer")

    def _checked_routing(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids as DeepEP's top-k index dtype and the weights as float32, both contiguous,
        after the shape and dtype checks (metadata only, unless check_ids)."""
        validate_dispatch_inputs(x_TH, topk_ids_TK, topk_weights_TK)
        self._check_tokens(x_TH)
        check_top_k(topk_ids_TK, self.top_k)
        if self.check_ids:
            check_expert_ids(topk_ids_TK, self.num_experts)
        topk_idx_TK = topk_ids_TK.to(self.topk_idx_dtype).contiguous()
        return topk_idx_TK, topk_weights_TK.float().contiguous()

    def _wire_tokens(self, x_TH: torch.Tensor):
        """What DeepEP's normal dispatch sends: bf16 rows, or (e4m3 rows, float32 [T, G]
        scales) quantized with megamoe's recipe (one scale per 128 channels)."""
        x_TH = x_TH.contiguous()
        if not self.fp8_dispatch:
            return x_TH
        from megamoe_kernels import quantize_rows

        rows_q, scales_GT = quantize_rows(x_TH)
        return rows_q, scales_GT.t()  # DeepEP takes [T, G] at any strides

    def _dispatch_v1(self, wire, topk_idx_TK: torch.Tensor, weights_TK: torch.Tensor):
        buffer = self.buffer
        _LAST_MODE_OF_BUFFER[buffer] = "normal"
        per_rank, per_rdma_rank, per_expert, in_rank, layout_done = buffer.get_dispatch_layout(
            topk_idx_TK,
            self.num_experts,
            previous_event=buffer.capture(),
            async_finish=True,
            allocate_on_comm_stream=True,
        )
        recv, recv_idx, recv_weights, counts, deep_handle, done = buffer.dispatch(
            wire,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx_TK,
            topk_weights=weights_TK,
            config=self.dispatch_config,
            previous_event=layout_done,
            async_finish=True,
            allocate_on_comm_stream=True,
        )
        done.current_stream_wait()
        return recv, recv_idx, recv_weights, counts, deep_handle

    def _dispatch_v2(self, wire, topk_idx_TK: torch.Tensor, weights_TK: torch.Tensor):
        buffer = self.buffer
        recv, recv_idx, recv_weights, deep_handle, done = buffer.dispatch(
            wire,
            topk_idx=topk_idx_TK,
            topk_weights=weights_TK,
            num_experts=self.num_experts,
            num_max_tokens_per_rank=self.max_tokens_per_rank,
            previous_event=buffer.capture(),
            async_with_compute_stream=True,
            allocate_on_comm_stream=True,
            do_cpu_sync=True,
        )
        done.current_stream_wait()
        return (
            recv,
            recv_idx,
            recv_weights,
            deep_handle.num_recv_tokens_per_expert_list,
            deep_handle,
        )

    def _place(
        self,
        deep_handle: Any,
        *,
        tokens: int,
        recv_idx_RK: torch.Tensor,
        recv_weights_RK: torch.Tensor,
        valid_rows: int,
    ) -> DeepEPNormalHandle:
        """Where each received (token, k) goes in the tight batch: sorted stably by local
        expert, then in receive order; the pairs of experts elsewhere (-1) sort last."""
        received, top_k = recv_idx_RK.shape
        local, device = self.num_local_experts, recv_idx_RK.device
        present_RK = recv_idx_RK >= 0
        expert_of_pair = torch.where(present_RK, recv_idx_RK, local).reshape(-1)
        pair_of_row, row_of_pair, expert_offsets = expert_major_order(
            expert_of_pair,
            expert_boundaries=torch.arange(local + 1, dtype=expert_of_pair.dtype, device=device),
            pair_indices=torch.arange(received * top_k, device=device),
        )
        return DeepEPNormalHandle(
            deep_handle=deep_handle,
            tokens=tokens,
            received=received,
            received_of_row=pair_of_row[:valid_rows] // top_k,
            expert_offsets=expert_offsets,
            row_of_pair_RK=torch.where(present_RK, row_of_pair.view(received, top_k), 0),
            pair_present_RK=present_RK,
            recv_topk_weights_RK=recv_weights_RK,
        )

    def _batch(self, recv, handle: DeepEPNormalHandle) -> ExpertBatch:
        """The tight batch: one row per local (token, k), gathered from the received rows."""
        rows_of = handle.received_of_row
        if not self.fp8_dispatch:
            return ExpertBatch(
                rows_MH=recv.index_select(0, rows_of),
                expert_offsets=handle.expert_offsets,
                valid_rows=handle.valid_rows,
            )
        recv_q, recv_scales_RG = recv
        return ExpertBatch(
            rows_MH=recv_q.index_select(0, rows_of),
            expert_offsets=handle.expert_offsets,
            valid_rows=handle.valid_rows,
            row_scales_GM=recv_scales_RG.index_select(0, rows_of).t().contiguous(),
        )

    def _dispatch_low_latency(
        self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, weights_TK: torch.Tensor
    ) -> tuple[ExpertBatch, DeepEPLowLatencyHandle]:
        if _LAST_MODE_OF_BUFFER.get(self.buffer) == "normal":
            # every rank switches at the same layer of the same forward, so all clean together
            self.buffer.clean_low_latency_buffer(
                self.max_tokens_per_rank, self.hidden_size, self.num_experts
            )
        _LAST_MODE_OF_BUFFER[self.buffer] = "low_latency"
        recv, recv_count_L, deep_handle, _, _ = self.buffer.low_latency_dispatch(
            x_TH.contiguous(),
            topk_idx_TK,
            self.max_tokens_per_rank,
            self.num_experts,
            use_fp8=self.fp8_dispatch,
            async_finish=False,
            return_recv_hook=False,
        )
        stride = self.world_size * self.max_tokens_per_rank
        # uniform routing brings a rank max_tokens x top-k rows: the class tuned knobs are for
        typical = min(self.max_tokens_per_rank * self.top_k, self.num_local_experts * stride)
        if self.fp8_dispatch:
            rows_q, scales_LSG = recv  # scales [L, S, G], column-major in their last two dims
            groups = scales_LSG.shape[2]
            batch = ExpertBatch.masked(
                rows_q,
                recv_count_L,
                row_scales_GM=scales_LSG.permute(2, 0, 1).reshape(groups, -1),
                typical_rows=typical,
            )
        else:
            batch = ExpertBatch.masked(recv, recv_count_L, typical_rows=typical)
        handle = DeepEPLowLatencyHandle(
            deep_handle=deep_handle,
            topk_idx_TK=topk_idx_TK,
            topk_weights_TK=weights_TK,
            rows_per_expert=stride,
        )
        return batch, handle

    # combine

    def combine(
        self,
        expert_out_MH: torch.Tensor,
        handle: DeepEPNormalHandle | DeepEPLowLatencyHandle,
    ) -> torch.Tensor:
        """y_TH for this rank's tokens: each token's expert outputs weighted by its routing
        weights and summed (normal mode: k order per rank, then the ranks' partials; low
        latency: k order on the source)."""
        if self.mode == "low_latency":
            return self._combine_low_latency(expert_out_MH, handle)
        if not isinstance(handle, DeepEPNormalHandle):
            raise TypeError(
                f"handle must come from this dispatcher's dispatch, got {type(handle).__name__}"
            )
        if expert_out_MH.dim() != 2 or expert_out_MH.shape[0] < handle.valid_rows:
            raise ValueError(
                f"expert_out must be [rows >= {handle.valid_rows}, hidden], got "
                f"{tuple(expert_out_MH.shape)}"
            )
        partial_RH = weighted_sum_over_topk(
            expert_out_MH,
            handle.row_of_pair_RK,
            handle.recv_topk_weights_RK,
            output_dtype=torch.bfloat16,
            pair_present_TK=handle.pair_present_RK,
        )
        buffer = self.buffer
        if self.api == "v1":
            combined_TH, _, done = buffer.combine(
                partial_RH,
                handle.deep_handle,
                config=self.combine_config,
                previous_event=buffer.capture(),
                async_finish=True,
                allocate_on_comm_stream=True,
            )
        else:
            combined_TH, _, done = buffer.combine(
                partial_RH,
                handle=handle.deep_handle,
                previous_event=buffer.capture(),
                async_with_compute_stream=True,
                allocate_on_comm_stream=True,
            )
        done.current_stream_wait()
        return combined_TH

    def _combine_low_latency(
        self, expert_out_MH: torch.Tensor, handle: DeepEPLowLatencyHandle
    ) -> torch.Tensor:
        if not isinstance(handle, DeepEPLowLatencyHandle):
            raise TypeError(
                f"handle must come from this dispatcher's dispatch, got {type(handle).__name__}"
            )
        local, stride = self.num_local_experts, handle.rows_per_expert
        expected = (local * stride, self.hidden_size)
        if tuple(expert_out_MH.shape) != expected or expert_out_MH.dtype != torch.bfloat16:
            raise ValueError(
                f"expert_out must be bf16 {list(expected)} (the masked batch's rows), got "
                f"{expert_out_MH.dtype} {list(expert_out_MH.shape)}"
            )
        combined_TH, _, _ = self.buffer.low_latency_combine(
            expert_out_MH.contiguous().view(local, stride, self.hidden_size),
            handle.topk_idx_TK,
            handle.topk_weights_TK,
            handle.deep_handle,
            async_finish=False,
            return_recv_hook=False,
        )
        return combined_TH
