"""Small eager forwards replayed from CUDA graphs the layer captures itself.

An eager forward of the fused path issues five or more launches, each a few microseconds of
Python and TVM-FFI on the host, plus the router GEMM's dispatch through torch: 100-540 us of
host time per forward measured on the H200 host, several times the GPU time of a decode step.
A replay costs the host one `cudaGraphLaunch`, after pointing the graph's first node, which
copies the tokens in, at the caller's tokens where they moved (graph_input.py; without the CUDA
runtime bindings a torch copy precedes the launch). docs/benchmarks.md has the numbers.

Forwards of 1 to `max_tokens` tokens replay a graph of their own shape. Longer ones, up to
`max_bucket_tokens`, replay the graph of their bucket: T rows, T the next power of two of the
tokens (at most max_bucket_tokens), captured for the first count of the bucket and replayed for
any count of it. Its nodes copy the count's tokens into the first rows of its static input and
the count into a device word, from a table of the counts 0..T (each replay points that copy at
its count's entry); the routing and combine kernels read the word and take that many tokens
(megamoe_kernels' token_count), so the copy, the dispatch, the GEMMs (which follow the device
offsets) and the combine do the forward's work alone. What a bucket's rows past the count cost:
the router GEMM and an output norm over them, and shared experts that run as their own MLP
(the fused path puts them in the batch where it can). The output is the first rows of the
static output, in x's shape. A bucket's results can differ from an eager forward's of the same
tokens in the router logits' last bits (the GEMM library picks its algorithm by the rows) and
so, where two experts' scores nearly tie, in a token's experts; a count's replays always give
the same bits.

`ForwardGraphs.forward(layer, x, input_ids=..., router_logits=...)` returns (y, router_logits_TE
or None), y in x's shape, or None where the forward should run eagerly. `input_ids`: the token
ids of a layer that routes by token id (its routing table looks their experts up inside the
graph), brought in by a second copy node as the tokens are; None for other layers. Graphs are
kept per (x's shape, dtype and device, the ids' shape, dtype and device, the caller's stream,
the identity and version of every parameter and buffer of the layer) under one layer config:
the first forward of a key runs eagerly (it compiles the kernels and warms the caches the
capture records), the second captures, the later ones replay.
Any change to a weight (in place, replaced, moved) changes the key, so a replay never reads
stale prepared weights; a new config (`use_backend`) drops every graph. At most `MAX_GRAPHS`
keys per layer, the least recently used dropped first.

The output a replay returns is the graph's own static output (an alias of it), not a copy: its
storage is allocated outside the graphs' pool, so no other graph's replay writes it, and a
graph replays only while no tensor of a caller shares that storage (its use count; torch's
own CUDA graph trees decide when an output is dead the same way). So a caller who drops each
output before the next forward of its key (a model's residual add) gets every forward replayed
with no copy out (a one-token qwen3-30b-a3b forward about 10 us less host time and wall
time than with a copy of the output: docs/benchmarks.md, "Replayed forwards hand out the
graph's output"); one who keeps the previous output gets a second graph of the key
(`GRAPHS_PER_KEY`), captured when first needed; one who keeps more gets the forward launched,
never an output overwritten. An output used on another stream needs `record_stream` there, as
any tensor the caching allocator may hand out again does. The router logits
(`router_logits=True`) come as a copy. The static input and output are normal tensors even
when the capture ran under `torch.inference_mode`, so a graph replays inside and outside it
alike, and its output takes in-place updates in both.

`ForwardGraphs.replay(layer, x, input_ids=..., router_logits=...)` is the layer's lean path,
taken before any other work of a forward that autograd does not record: the replay of a graph
already captured for this key (which the layer's checks admitted when it captured: the ids'
shape and device among them) whose output is free, or None. Its host time is the key (an
address and a version per parameter), the copy nodes' updates where the tokens or ids moved,
and the graph launch.

The graphs of one (device, stream), every layer's, share one memory pool while one of them
lives: replays on one stream never overlap, and each graph's static input (outside the pool)
and router logits stay allocated while it lives, so a capture only reuses the pool's memory
that no live graph's logits hold. A graph's router logits may lie in the scratch of a graph
captured before it: they are copied out right after its replay.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from megamoe_torch.graph_input import CopySource, copy_node_updates_available
from megamoe_torch.tensor_cache import tensor_versions

MAX_GRAPHS = 16
# graphs of one key: the second takes the forwards whose caller still holds the first's output
GRAPHS_PER_KEY = 2
# token counts seen once and not captured (yet), remembered for their second forward
MAX_SEEN = 64

# whether captures copy the tokens in by a node of the graph (graph_input.py): off for the
# process once a capture's copy did not come out as one memcpy node
_copies_in_graph = copy_node_updates_available()

# the live graphs captured for each (device, stream): a capture shares the memory pool of one
# of them (a pool none of whose graphs lives is never handed out again)
_LIVE_GRAPHS: dict[tuple[int, int], weakref.WeakSet] = {}


def _shared_pool(device_index: int, stream: int) -> tuple:
    for graph in _LIVE_GRAPHS.get((device_index, stream), ()):
        return graph.pool()
    return torch.cuda.graph_pool_handle()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor  # the static input, in the caller's shape
    y: torch.Tensor  # the static output (outside the pool), in the caller's shape
    router_logits_TE: torch.Tensor
    # the graph's first node, copying the tokens into x (None: copied by torch before a replay)
    copy_source: CopySource | None = None
    # a layer routing by token id: the static ids [T] and the node copying them in (None: by
    # torch, as the tokens)
    ids: torch.Tensor | None = None
    ids_copy_source: CopySource | None = None
    # a graph of a bucket of token counts: its rows T (x and y are [T, H]), the device word the
    # kernels read the count from, the table of counts 0..T it is copied from, and the node
    # that copies it (None: by torch); None for a graph of one shape
    bucket: int | None = None
    token_count: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    count_copy_source: CopySource | None = None
    # y's storage, held: with y, the two references to it while no caller holds an output
    y_storage: torch.UntypedStorage = field(init=False)

    def __post_init__(self) -> None:
        self.y_storage = self.y.untyped_storage()

    def output_free(self) -> bool:
        """Whether no tensor but this graph's own shares its output's storage."""
        return torch._C._storage_Use_Count(self.y_storage._cdata) == 2

    def run(
        self, x: torch.Tensor, input_ids: torch.Tensor | None, router_logits: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Replays (the output must be free) and returns (an alias of the output, a copy of the
        router logits or None); None where the tokens or ids could not be brought in (nothing
        ran)."""
        if self.bucket is not None:
            return self._run_bucket(x, input_ids, router_logits)
        if self.copy_source is None:
            self.x.copy_(x)
            if self.ids is not None:
                self.ids.copy_(input_ids.reshape(-1))
        else:
            # the graph's copies read x and the ids at its launch, in stream order (a contiguous
            # copy made here is freed to this stream's pool, behind that launch)
            if not _points_at(self.copy_source, x):
                return None
            if self.ids is not None and not _points_at(self.ids_copy_source, input_ids):
                return None
        self.graph.replay()
        # the logits may lie in another graph's scratch: the caller gets its own
        logits_TE = self.router_logits_TE.clone() if router_logits else None
        # a new tensor of y's storage (what output_free counts); detach is the cheapest
        return self.y.detach(), logits_TE

    def _run_bucket(
        self, x: torch.Tensor, input_ids: torch.Tensor | None, router_logits: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """run() of a bucket's graph: its first rows take x's tokens, the count word their
        count; the output is y's first rows in x's shape."""
        tokens = x.numel() // self.x.shape[1]
        if self.copy_source is None:
            _bring_in(self.x, self.ids, self.token_count, self.counts, x, input_ids, tokens)
        else:
            if not _points_at(self.copy_source, x, nbytes=x.numel() * x.element_size()):
                return None
            if self.ids is not None and not _points_at(
                self.ids_copy_source, input_ids, nbytes=tokens * input_ids.element_size()
            ):
                return None
            count_entry = self.counts.data_ptr() + tokens * self.counts.element_size()
            if not self.count_copy_source.point_at(count_entry):
                return None
        self.graph.replay()
        logits_TE = self.router_logits_TE[:tokens].clone() if router_logits else None
        # narrow, and a view only for tokens of another shape: each op costs the host
        y = self.y.narrow(0, 0, tokens)
        return (y if x.dim() == 2 else y.view(x.shape)), logits_TE


class ForwardGraphs:
    """The captured forwards of one layer (see the module docstring): of one shape up to
    `max_tokens` tokens, of a bucket of counts up to `max_bucket_tokens` (0, or at most
    max_tokens: none). A capture records `layer._fused_forward_from_tokens(x_TH)`, which computes
    (y_TH, router_logits_TE) as an eager forward does; the layer decides which forwards may be
    captured (the fused path on one GPU, no autograd, no outer capture or compile, no
    host-synchronising checks). A copy or a pickle of the layer starts with no graphs.

    The layer comes with each call rather than being held: a layer and its graphs form no
    reference cycle, so a dropped layer's graphs are destroyed when its last reference goes,
    never by the cycle collector in the middle of another capture (destroying a graph there
    invalidates that capture)."""

    def __init__(self, *, max_tokens: int, max_bucket_tokens: int = 0):
        self.max_tokens = max_tokens
        self.max_bucket_tokens = max_bucket_tokens
        # the most tokens any graph takes
        self._most_tokens = max(max_tokens, max_bucket_tokens)
        self._forget()

    def _forget(self) -> None:
        self._config = None  # the layer config the graphs were captured under
        self._graphs: OrderedDict[tuple, list[_Graph]] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._modules: tuple = ()
        self._tensor_slots: list[tuple[dict, str]] = []

    def __getstate__(self) -> dict:
        return {"max_tokens": self.max_tokens, "max_bucket_tokens": self.max_bucket_tokens}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._forget()

    def __len__(self) -> int:
        return len(self._graphs)

    def takes(self, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens is one the graphs may hold: 1 to max_tokens,
        or to max_bucket_tokens. Asked before anything else, so that a longer forward costs no
        other question."""
        return 0 < tokens <= self._most_tokens

    def bucket_of(self, tokens: int) -> int | None:
        """The rows of the bucket graph a forward of `tokens` (that the graphs take) replays:
        the next power of two, at most max_bucket_tokens; None up to max_tokens (a graph of
        the forward's own shape)."""
        if tokens <= self.max_tokens:
            return None
        return min(1 << (tokens - 1).bit_length(), self.max_bucket_tokens)

    def clear(self) -> None:
        """Drops every graph (their memory returns to the pool)."""
        self._forget()

    def _weights_signature(self, layer: torch.nn.Module) -> tuple:
        """(address, version) of each parameter and buffer the forward may read: any change
        to one gives another signature (the slots are listed once, while the layer's
        submodules stay the same objects)."""
        modules = tuple(layer._modules.values())
        if len(modules) != len(self._modules) or not all(map(operator.is_, modules, self._modules)):
            self._modules = modules
            self._tensor_slots = [
                (container, name)
                for module in layer.modules()
                for container in (module._parameters, module._buffers)
                for name in container
            ]
        return tensor_versions([container[name] for container, name in self._tensor_slots])

    def _key(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        input_ids: torch.Tensor | None,
        device_index: int,
    ) -> tuple:
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        tokens = x.numel() // layer.config.hidden_size
        bucket = self.bucket_of(tokens)
        # a bucket's graph takes tokens of any shape of its counts, rows of the hidden size,
        # and ids of any shape, one a token (as the layer's checks admitted at the capture)
        shape = x.shape if bucket is None else ("bucket", bucket, x.shape[-1])
        ids = None
        if input_ids is not None:
            ids_shape = input_ids.shape if bucket is None else input_ids.numel() == tokens
            ids = (ids_shape, input_ids.dtype, input_ids.get_device())
        return (shape, x.dtype, ids, device_index, stream, self._weights_signature(layer))

    def replay(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        *,
        input_ids: torch.Tensor | None = None,
        router_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The replay of a graph captured for this forward's key whose output is free, or None
        (no such graph, another config, a CPU tensor, or the caller's stream capturing a graph
        of its own)."""
        if not self._graphs or layer.config is not self._config:
            return None
        if not self.takes(x.numel() // layer.config.hidden_size):
            return None  # no graph holds it: asked before the key's weight versions
        device_index = x.get_device()
        if device_index < 0:
            return None
        key = self._key(layer, x, input_ids, device_index)
        entry = _free_graph(self._graphs.get(key, ()))
        if entry is None or torch.cuda.is_current_stream_capturing():
            return None
        return entry.run(x, input_ids, router_logits)

    def forward(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        *,
        input_ids: torch.Tensor | None = None,
        router_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A forward the layer admitted for graphs (and, routing by token id, its checked
        input_ids): replayed, captured (the second forward of its key, or one whose caller holds
        the output of the key's only graph) or None (the first: run it eagerly; or every
        graph's output held)."""
        if not self.takes(x.numel() // layer.config.hidden_size):
            return None
        if layer.config is not self._config:
            self._forget()
            self._config = layer.config
        device_index = x.get_device()
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        key = self._key(layer, x, input_ids, device_index)
        graphs = self._graphs.get(key)
        if graphs is None:
            if key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > MAX_SEEN:
                    self._seen.popitem(last=False)
                return None
            del self._seen[key]
            graphs = self._graphs[key] = []
            if len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        entry = _free_graph(graphs)
        if entry is None:
            if len(graphs) == GRAPHS_PER_KEY:
                return None
            entry = self._capture(layer, x, input_ids, device_index, stream)
            if entry is None:
                return None
            graphs.append(entry)
        return entry.run(x, input_ids, router_logits)

    def _capture(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        input_ids: torch.Tensor | None,
        device_index: int,
        stream: int,
    ) -> _Graph | None:
        """A graph of this forward (of its bucket where it has one), its tokens (and ids, and a
        bucket's count) copied in by its first nodes (graph_input.py) where those nodes can be
        pointed at each replay's; else by torch before each replay. None where a copy did not
        come out as such a node: the forward launches, and later captures copy with torch."""
        global _copies_in_graph
        hidden = layer.config.hidden_size
        tokens = x.numel() // hidden
        bucket = self.bucket_of(tokens)
        # the static input and output, allocated before the capture: outside the shared pool.
        # Normal tensors even under inference mode: a replay outside it writes the input in
        # place, and a caller may write the output in place. A bucket's rows past a count hold
        # the tokens of earlier replays: zeros at first (finite, and ids in range)
        with torch.inference_mode(False):
            if bucket is None:
                static_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
                static_y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            else:
                static_x = torch.zeros((bucket, hidden), dtype=x.dtype, device=x.device)
                static_y = torch.empty((bucket, hidden), dtype=x.dtype, device=x.device)
            static_ids = token_count = counts = None
            if input_ids is not None:
                ids_rows = input_ids.numel() if bucket is None else bucket
                static_ids = torch.zeros(ids_rows, dtype=input_ids.dtype, device=x.device)
            if bucket is not None:
                token_count = torch.empty(1, dtype=torch.int32, device=x.device)
                counts = torch.arange(bucket + 1, dtype=torch.int32, device=x.device)
        copies_in_graph = _copies_in_graph
        # the tokens (and ids) the graph's copies read at the capture (later replays point them
        # elsewhere)
        source = x.contiguous().view(-1, hidden) if copies_in_graph else None
        ids_source = None
        if copies_in_graph and input_ids is not None:
            ids_source = input_ids.contiguous().view(-1)
        forward = functools.partial(
            layer._fused_forward_from_tokens,
            static_x.view(-1, hidden),
            input_ids=static_ids,
            out_TH=static_y.view(-1, hidden),
            token_count=token_count,
        )
        if bucket is not None:
            # the kernels that read the count compile at a bucket's first forward, not inside
            # its capture: run it once (its output is discarded; the replay writes it again)
            _bring_in(static_x, static_ids, token_count, counts, x, input_ids, tokens)
            forward()
        graph = torch.cuda.CUDAGraph(keep_graph=True) if copies_in_graph else torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls during the capture are not an error
        with torch.cuda.graph(
            graph, pool=_shared_pool(device_index, stream), capture_error_mode="thread_local"
        ):
            if copies_in_graph:
                _bring_in(static_x, static_ids, token_count, counts, source, ids_source, tokens)
            _, router_logits_TE = forward()
        copy_source = ids_copy_source = count_copy_source = None
        if copies_in_graph:
            graph.instantiate()
            copy_source = _copy_node(graph, static_x, source, device_index)
            found = copy_source is not None
            if static_ids is not None and found:
                ids_copy_source = _copy_node(graph, static_ids, ids_source, device_index)
                found = ids_copy_source is not None
            if bucket is not None and found:
                count_copy_source = _copy_node(
                    graph, token_count, counts[tokens : tokens + 1], device_index
                )
                found = count_copy_source is not None
            if not found:
                _copies_in_graph = False
                return None
        _LIVE_GRAPHS.setdefault((device_index, stream), weakref.WeakSet()).add(graph)
        return _Graph(
            graph,
            static_x,
            static_y,
            router_logits_TE,
            copy_source,
            static_ids,
            ids_copy_source,
            bucket,
            token_count,
            counts,
            count_copy_source,
        )


def _bring_in(static_x, static_ids, token_count, counts, x, input_ids, tokens: int) -> None:
    """Copies a forward's `tokens` tokens (and ids) into the first rows of the static input (a
    bucket's: and the count into its word, from the table of counts) with torch: the copies a
    capture records as nodes, or that precede a replay whose graph has none."""
    static_x.view(-1, x.shape[-1])[:tokens].copy_(x.reshape(tokens, -1))
    if static_ids is not None:
        static_ids[:tokens].copy_(input_ids.reshape(-1))
    if token_count is not None:
        token_count.copy_(counts[tokens : tokens + 1])


def _copy_node(
    graph: torch.cuda.CUDAGraph, static: torch.Tensor, source: torch.Tensor, device_index: int
) -> CopySource | None:
    """The node of `graph` that copies `source` (all of it) into the start of `static`
    (graph_input.py), or None."""
    return CopySource.find(
        graph,
        dst=static.data_ptr(),
        src=source.data_ptr(),
        nbytes=source.numel() * source.element_size(),
        device_index=device_index,
    )


def _points_at(copy_source: CopySource, tensor: torch.Tensor, nbytes: int | None = None) -> bool:
    """Points a graph's copy node at `tensor` (made contiguous first where it is not; `nbytes`
    of it, None: as many as the last launch copied); False where the runtime refused."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return copy_source.point_at(tensor.data_ptr(), nbytes)


def _free_graph(graphs) -> _Graph | None:
    """The first of `graphs` whose output no caller holds, or None."""
    for graph in graphs:
        if graph.output_free():
            return graph
    return None
