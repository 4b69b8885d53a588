"""The cutedsl backend: megamoe's CuTe DSL grouped GEMMs (megamoe_kernels) on sm_90a.

gate-up GEMM with the SwiGLU epilogue on the gate/up interleaved w13, then the down GEMM
(optionally scaling each row by its routing weight). A pack's biases and SwiGLU (gpt-oss's
clamped one) are the GEMMs' epilogue variants: the w13 bias interleaved like w13 and both kept
in float32 at prepare time, added to the accumulators before the activation and before the
row scale. Both read `expert_offsets` on the GPU: no host sync, fixed shapes for a fixed
capacity, so the pair replays in a CUDA graph.

FP8 weights (a Prequantized pack, which holds no biases) run the FP8 GEMMs: the batch rows are
quantized to e4m3 per row and 128 columns, the gate-up GEMM's epilogue computes the pack's
SwiGLU variant and quantizes its output per 64 or 128 columns for the down GEMM, which writes
bf16. Their knobs come as the bf16 GEMMs' do, under
their own ops ("gate_up_fp8", "down_fp8"): explicit ones, else the knob cache's (filled by
`megamoe tune` or the layer's online autotune), else the kernels' default profiles.

A masked batch (per-expert counts at a fixed stride: DeepEP's low-latency receive layout) is
read in place: the kernels' expert walk reads the counts beside the offsets, so they compute
the counted rows only. A gathered batch (the tokens and the token of each batch row) goes to
the gathering gate-up GEMM; the FP8 path copies its rows out first. A batch whose offsets the
routing kernel publishes before it ends (`offsets_published`) lets the decode gate-up GEMM
start loading its weights then.

The down GEMM can also do the combine (`row_tokens_M`, `out_TH`; `combines_rows`): it adds
each batch row's output, times its routing weight (row_scale_M), into its token's row of
out_TH by atomic bf16 reductions at the L2, in no fixed order (not deterministic).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from megamoe_kernels import (
    PACKED_TILE_COLS,
    GemmKnobs,
    GemmLauncher,
    SwiGLU,
    current_stream_handle,
    down_fp8_launcher,
    down_launcher,
    gate_up_fp8_launcher,
    gate_up_launcher,
    is_packed_weight,
    keeps_buffers,
    stored_weight_dims,
)

from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts.base import check_batch_matches_weights
from megamoe_runtime.tuning.cache import KnobCache, KnobKey
from megamoe_runtime.weights import Prequantized, WeightPack


def cutedsl_status(device: torch.device) -> tuple[bool, str]:
    """(can run, why) for the CuTe DSL kernels on `device`."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"the CuTe DSL kernels need an sm_90 CUDA GPU, got device {device}"
    if not torch.cuda.is_available():
        return False, "CUDA is not available to torch"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return False, f"the CuTe DSL kernels are built for sm_90a; this GPU is sm_{major}{minor}"
    if importlib.util.find_spec("cutlass") is None:
        return False, "nvidia-cutlass-dsl (import cutlass) is not installed"
    return True, "sm_90 GPU with CuTe DSL"


class _KernelLayoutDims:
    """What check_batch_matches_weights and the backend read of weights in the kernels' layout
    (row-major or packed: megamoe_kernels.stored_weight_dims tells either's dims)."""

    w2_EHI: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w2_EHI.shape[0]

    @property
    def hidden_size(self) -> int:
        return stored_weight_dims(self.w2_EHI)[1]

    @property
    def intermediate_size(self) -> int:
        return stored_weight_dims(self.w2_EHI)[2]


@dataclass(frozen=True)
class CuteDSLWeights(_KernelLayoutDims):
    """Weights in the kernels' layout: w13 as the pack holds it ([E, 2I, H], no copy; the
    gate-up GEMMs read it in the interleaved order) and w2 as given, or both packed (tile_pack:
    megamoe_kernels.pack_weight_tiles, from the interleaved copy); the biases in float32,
    w13's interleaved ([E, I/8, 16]), w2's [E, H]; the SwiGLU. A copy made here is all the
    backend keeps of the pack's weights besides the tensors it shares."""

    w13: torch.Tensor
    w2_EHI: torch.Tensor
    swiglu: SwiGLU = field(default_factory=SwiGLU)
    w13_bias_EB2G: torch.Tensor | None = None
    w2_bias_EH: torch.Tensor | None = None

    @property
    def w13_E2IH(self) -> torch.Tensor:  # check_batch_matches_weights reads its dtype, device
        return self.w13


@dataclass(frozen=True)
class CuteDSLFP8Weights(_KernelLayoutDims):
    """FP8 weights in the kernels' layout: e4m3 w13 as the pack holds it with its block scales
    over its rows, e4m3 w2 with its block scales; or both packed (tile_pack), each scale a view
    of its weight's allocation (the packets' scale words); the SwiGLU."""

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2_EHI: torch.Tensor
    w2_scales: torch.Tensor
    swiglu: SwiGLU = field(default_factory=SwiGLU)

    @property
    def w13_E2IH(self) -> torch.Tensor:  # check_batch_matches_weights reads its device
        return self.w13


class CuteDSLExperts:
    name = "cutedsl"
    supports_autograd = False
    captures_in_graphs = True
    # the down GEMM can add its rows into their tokens' rows (__call__'s row_tokens_M)
    combines_rows = True

    def __init__(
        self,
        *,
        gate_up_knobs=None,
        down_knobs=None,
        knob_cache: KnobCache | None = None,
        tile_pack: bool = False,
    ):
        # None: tuned knobs from the knob cache (`megamoe tune`) if it holds the batch's class,
        # else from the entries megamoe ships, else the kernels' default profile for the batch's
        # rows per expert
        self.gate_up_knobs = gate_up_knobs
        self.down_knobs = down_knobs
        # prepare() lays the weights out in packets (megamoe_kernels.pack_weight_tiles): the
        # same bits, read tile by tile; a shape it cannot pack is refused there
        self.tile_pack = bool(tile_pack)
        self.knob_cache = KnobCache() if knob_cache is None else knob_cache
        self._launchers: dict[tuple, tuple[GemmLauncher, GemmLauncher]] = {}
        self._kept_intermediate: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def _ops(prepared: CuteDSLWeights | CuteDSLFP8Weights) -> tuple[str, str]:
        """The gate-up and the down GEMM's ops for the weights (their knob-cache keys' ops)."""
        if isinstance(prepared, CuteDSLFP8Weights):
            return "gate_up_fp8", "down_fp8"
        return "gate_up", "down"

    @classmethod
    def _weight_dims(
        cls, prepared: CuteDSLWeights | CuteDSLFP8Weights
    ) -> dict[str, tuple[int, int]]:
        """(N, K) of each op's weight: gate-up (2I, H), down (H, I)."""
        hidden, intermediate = prepared.hidden_size, prepared.intermediate_size
        gate_up, down = cls._ops(prepared)
        return {gate_up: (2 * intermediate, hidden), down: (hidden, intermediate)}

    def _explicit_knobs(
        self, prepared: CuteDSLWeights | CuteDSLFP8Weights
    ) -> dict[str, GemmKnobs | None]:
        """The knobs given at construction, by op (they run the FP8 GEMMs of FP8 weights too)."""
        gate_up, down = self._ops(prepared)
        return {gate_up: self.gate_up_knobs, down: self.down_knobs}

    def knob_keys(self, batch: ExpertBatch, prepared: CuteDSLWeights) -> dict[str, KnobKey]:
        """The knob-cache key of the batch's class for each op whose knobs are looked up (not
        given explicitly), gate-up first."""
        from megamoe_runtime.tuning.expert_knobs import batch_gemm_key

        explicit = self._explicit_knobs(prepared)
        return {
            op: batch_gemm_key(op, batch, weight_dims=weight_dims)
            for op, weight_dims in self._weight_dims(prepared).items()
            if explicit[op] is None
        }

    def knob_candidates(
        self, op: str, batch: ExpertBatch, prepared: CuteDSLWeights
    ) -> list[GemmKnobs]:
        """What the online autotuner times for `op` on this batch: first the knobs that run it
        without a tuned entry (the default profile's for the batch's capacity: stored as a tuned
        entry they launch the same kernels), then every candidate that keeps their numbers (K
        summed whole, or in the same slices where they split it: `gemm_candidates`,
        `with_the_numbers_of`), the profile's ring of each tile shape, on packed weights those
        whose tiles packets serve. The list's length does not depend on the batch (ranks time
        it in lockstep), so the first may appear more than once."""
        from megamoe_kernels import default_launches

        from megamoe_runtime.tuning.expert_knobs import gemm_candidates, with_the_numbers_of

        device = batch.rows_MH.device
        untuned = default_launches(
            op,
            batch.capacity,
            batch.num_experts,
            weight_dims=self._weight_dims(prepared)[op],
            sms=torch.cuda.get_device_properties(device).multi_processor_count,
        )[-1].knobs
        candidates = with_the_numbers_of(
            untuned, gemm_candidates(op, quick=True, same_numbers=True)
        )
        # packed weights (every rank's layer lays its weights out alike): the tiles packets serve
        return [untuned, *(k for k in candidates if self._reads_the_weights(prepared, k))]

    @staticmethod
    def _reads_the_weights(prepared: CuteDSLWeights | CuteDSLFP8Weights, knobs) -> bool:
        """Whether a GEMM with `knobs` reads the prepared weights' layout: any tile reads
        row-major weights; packed ones take tiles of PACKED_TILE_COLS weight rows."""
        return not is_packed_weight(prepared.w2_EHI) or knobs.tile_cols in PACKED_TILE_COLS

    def expert_runner(
        self,
        batch: ExpertBatch,
        prepared: CuteDSLWeights,
        *,
        knobs: Mapping[str, GemmKnobs],
    ) -> Callable[[], torch.Tensor]:
        """The expert MLP on `batch` with `knobs` (op -> knobs) in place of the looked-up ones,
        as a knob-cache entry would put them (compiled here): what the online autotuner times."""
        if isinstance(prepared, CuteDSLFP8Weights):
            batch = batch.materialized()
            rows = self._fp8_rows(batch)  # quantized once: the candidates time the GEMMs
            launchers = self._bind_fp8(batch, rows[0], prepared, None, tuned=knobs)
            return lambda: self._launch_fp8(launchers, rows, batch, prepared, None)
        gate_up, down = self._bind(batch, prepared, None, tuned=knobs)
        rows_MH, offsets, row_source_M = batch.rows_MH, batch.expert_offsets, batch.row_source_M
        counts = batch.expert_counts

        def run() -> torch.Tensor:
            hidden_MI = gate_up(
                rows_MH,
                offsets,
                prepared.w13,
                row_source_M=row_source_M,
                expert_counts=counts,
                bias=prepared.w13_bias_EB2G,
            )
            return down(
                hidden_MI,
                offsets,
                prepared.w2_EHI,
                expert_counts=counts,
                bias=prepared.w2_bias_EH,
            )

        return run

    def forget_launchers(self) -> None:
        """Drops the launchers bound so far: the next call of each class looks its knobs up again
        (after the knob cache gained an entry)."""
        self._launchers.clear()

    def _cached_knobs(self, op: str, batch: ExpertBatch, weight_dims: tuple[int, int]):
        """Tuned knobs for the batch's class (its typical rows, else its capacity) from the
        knob cache or the shipped entries, or None (defaults)."""
        from megamoe_runtime.tuning.expert_knobs import batch_gemm_key, looked_up_knobs

        key = batch_gemm_key(op, batch, weight_dims=weight_dims)
        return looked_up_knobs(self.knob_cache, key)

    def _knob_arguments(
        self,
        batch: ExpertBatch,
        prepared: CuteDSLWeights,
        tuned: Mapping[str, GemmKnobs] | None = None,
    ) -> tuple[dict, dict]:
        """The gate-up and the down GEMM's knob arguments for the batch's class: the explicit
        knobs (run exactly), else tuned ones (`tuned`'s, else the knob cache's or the shipped
        entries'; in place of the default profile's, which still hands small batches to the
        decode tiles), else none (the default profile)."""
        tuned = tuned or {}
        explicit = self._explicit_knobs(prepared)
        weight_dims = self._weight_dims(prepared)

        def arguments(op: str) -> dict:
            if explicit[op] is not None:
                return {"knobs": explicit[op]}
            if op in tuned:
                return {"tuned_knobs": tuned[op]}
            cached = self._cached_knobs(op, batch, weight_dims[op])
            if cached is not None and not self._reads_the_weights(prepared, cached):
                cached = None  # tuned for row-major weights with tiles packets do not serve
            return {"tuned_knobs": cached}

        gate_up, down = self._ops(prepared)
        return arguments(gate_up), arguments(down)

    def _bind(
        self,
        batch: ExpertBatch,
        prepared: CuteDSLWeights,
        row_scale_M: torch.Tensor | None,
        *,
        tuned: Mapping[str, GemmKnobs] | None = None,
        row_tokens_M: torch.Tensor | None = None,
    ) -> tuple[GemmLauncher, GemmLauncher]:
        """The gate-up and the down GEMM's launchers for the batch's class (compiled here on
        first use); `tuned`: knobs for some ops in place of the looked-up ones; `row_tokens_M`:
        a down GEMM that adds its rows into their tokens' rows."""
        gate_up_knobs, down_knobs = self._knob_arguments(batch, prepared, tuned)
        rows_MH, offsets = batch.rows_MH, batch.expert_offsets
        gate_up = gate_up_launcher(
            rows_MH,
            offsets,
            prepared.w13,
            valid_rows=batch.valid_rows,
            row_source_M=batch.row_source_M,
            expert_counts=batch.expert_counts,
            w13_bias_EB2G=prepared.w13_bias_EB2G,
            swiglu=prepared.swiglu,
            offsets_published=batch.offsets_published,
            **gate_up_knobs,
        )
        intermediate = prepared.intermediate_size
        down = down_launcher(
            rows_MH.new_empty((batch.capacity, intermediate)),
            offsets,
            prepared.w2_EHI,
            row_scale_M=row_scale_M,
            valid_rows=batch.valid_rows,
            expert_counts=batch.expert_counts,
            w2_bias_EH=prepared.w2_bias_EH,
            row_source_M=row_tokens_M,
            **down_knobs,
        )
        return gate_up, down

    def _intermediate(self, batch: ExpertBatch, gate_up: GemmLauncher) -> torch.Tensor:
        """The gate-up GEMM's output, kept per (device, stream) for the last shape instead of
        allocated per call: the same call's down GEMM is its only reader, and calls on one
        stream run in order (a later gate-up waits for the down GEMM before it). Where no buffer
        may be kept (megamoe_kernels.keeps_buffers: under CUDA-graph capture, where the graph's
        pool owns it, or inside fresh_scratch) it is allocated anew."""
        rows_MH = batch.rows_MH
        shape = (batch.capacity, gate_up.columns)
        device = rows_MH.device
        if device.type != "cuda" or not keeps_buffers():
            return rows_MH.new_empty(shape)
        key = (device, current_stream_handle(device))
        kept = self._kept_intermediate.get(key)
        if kept is None or kept.shape != shape:
            kept = self._kept_intermediate[key] = rows_MH.new_empty(shape)
        return kept

    def prepare(self, weights: WeightPack) -> CuteDSLWeights | CuteDSLFP8Weights:
        from megamoe_kernels import interleave_gate_up_bias

        if self.tile_pack:
            self._check_packable(weights)
        if isinstance(weights, Prequantized):
            if weights.intermediate_size % 128:
                raise ValueError(
                    "the FP8 kernels take an intermediate size that is a multiple of 128 (a "
                    f"tile's gate and up rows each lie in one weight block), got "
                    f"{weights.intermediate_size}: use backend='reference' or bf16 weights"
                )
            w13, w13_scales = self._packed(
                self._gate_up_order(weights.w13_E2IH), weights.w13_scales.contiguous(), gate_up=True
            )
            w2, w2_scales = self._packed(
                weights.w2_EHI.contiguous(), weights.w2_scales.contiguous(), gate_up=False
            )
            return CuteDSLFP8Weights(
                w13=w13,
                w13_scales=w13_scales,
                w2_EHI=w2,
                w2_scales=w2_scales,
                swiglu=weights.swiglu,
            )
        if weights.w13_E2IH.dtype != torch.bfloat16:
            raise TypeError(f"the cutedsl backend runs bf16 weights, got {weights.w13_E2IH.dtype}")
        if not weights.gated:
            raise ValueError(
                "the cutedsl kernels compute gated (SwiGLU) experts, not "
                f"{weights.activation} ones: use backend='grouped_mm' or 'reference'"
            )
        w13_bias, w2_bias = weights.w13_bias_E2I, weights.w2_bias_EH
        w13, _ = self._packed(self._gate_up_order(weights.w13_E2IH), None, gate_up=True)
        w2, _ = self._packed(weights.w2_EHI.contiguous(), None, gate_up=False)
        return CuteDSLWeights(
            w13=w13,
            w2_EHI=w2,
            swiglu=weights.swiglu,
            w13_bias_EB2G=None if w13_bias is None else interleave_gate_up_bias(w13_bias),
            w2_bias_EH=None if w2_bias is None else w2_bias.float().contiguous(),
        )

    def _gate_up_order(self, w13_E2IH: torch.Tensor) -> torch.Tensor:
        """w13 as the gate-up GEMMs read it: the pack's own tensor (made contiguous), or, to be
        packed, interleave_gate_up's copy (the packets hold the interleaved order)."""
        from megamoe_kernels import interleave_gate_up

        return interleave_gate_up(w13_E2IH) if self.tile_pack else w13_E2IH.contiguous()

    def _check_packable(self, weights: WeightPack) -> None:
        """tile_pack: refuses, with every reason, weights the packet layout cannot hold."""
        from megamoe_kernels import pack_problems

        dtype = weights.w13_E2IH.dtype
        hidden, intermediate = weights.hidden_size, weights.intermediate_size
        problems = [
            f"{name}: {problem}"
            for name, n, k, gate_up in (
                ("w13", 2 * intermediate, hidden, True),
                ("w2", hidden, intermediate, False),
            )
            for problem in pack_problems(dtype, n, k, gate_up=gate_up)
        ]
        if not isinstance(weights, Prequantized) and (
            weights.w13_bias_E2I is not None or weights.w2_bias_EH is not None
        ):
            problems.append("the pack has expert biases (packed GEMMs are built without them)")
        if problems:
            raise ValueError(
                "tile_pack=True cannot lay these weights out in packets: "
                + "; ".join(problems)
                + " (tile_pack=False keeps them row-major)"
            )

    def _packed(
        self, weight: torch.Tensor, scales: torch.Tensor | None, *, gate_up: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight (and FP8 scales) as the GEMMs take them: packed with tile_pack, else as
        given."""
        if not self.tile_pack:
            return weight, scales
        from megamoe_kernels import pack_weight_tiles

        return pack_weight_tiles(weight, scales, gate_up=gate_up)

    def __call__(
        self,
        batch: ExpertBatch,
        prepared: CuteDSLWeights,
        *,
        row_scale_M: torch.Tensor | None = None,
        row_tokens_M: torch.Tensor | None = None,
        out_TH: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """expert_out_MH (the rows' outputs, times row_scale_M where given); with row_tokens_M
        (int32 [capacity], each batch row's token) the combine instead: each valid row's output,
        times its row_scale_M, added into out_TH[token] (bf16 [T, H], holding what the rows add
        to: zeros) by atomic reductions, in no fixed order; returns out_TH."""
        if (row_tokens_M is None) != (out_TH is None):
            raise ValueError(
                "row_tokens_M and out_TH come together (the rows are added into the tokens' "
                f"rows of out_TH), got row_tokens_M {'None' if row_tokens_M is None else 'given'}"
                f" and out_TH {'None' if out_TH is None else 'given'}"
            )
        if isinstance(prepared, CuteDSLFP8Weights):
            return self._fp8_expert_mlp(batch, prepared, row_scale_M, row_tokens_M, out_TH)
        batch = batch.dequantized()  # FP8 rows (an FP8 dispatch) for bf16 experts
        if not isinstance(prepared, CuteDSLWeights):
            raise TypeError(
                f"prepared must come from CuteDSLExperts.prepare, got {type(prepared).__name__}"
            )
        # the kernels' compiled signatures check every tensor on each launch; the batch-level
        # checks run only to name the culprit when a launch refuses its arguments
        rows_MH, offsets = batch.rows_MH, batch.expert_offsets
        try:
            # the launchers of the batch's class, bound once: a later call costs this lookup,
            # two output allocations and two launches
            memo = (
                batch.capacity,
                batch.is_gathered,
                batch.is_masked,
                batch.typical_rows,
                batch.valid_rows,
                batch.offsets_published,
                rows_MH.get_device(),
                rows_MH.dtype,
                prepared.w2_EHI.shape,
                row_scale_M is None,
                row_tokens_M is None,
                prepared.w13_bias_EB2G is None,
                prepared.w2_bias_EH is None,
                prepared.swiglu,
            )
            launchers = self._launchers.get(memo)
            if launchers is None:
                launchers = self._launchers[memo] = self._bind(
                    batch, prepared, row_scale_M, row_tokens_M=row_tokens_M
                )
            gate_up, down = launchers
            hidden_MI = gate_up(
                rows_MH,
                offsets,
                prepared.w13,
                out=self._intermediate(batch, gate_up),
                row_source_M=batch.row_source_M,
                expert_counts=batch.expert_counts,
                bias=prepared.w13_bias_EB2G,
            )
            return down(
                hidden_MI,
                offsets,
                prepared.w2_EHI,
                row_scale_M=row_scale_M,
                out=out_TH,
                row_source_M=row_tokens_M,
                expert_counts=batch.expert_counts,
                bias=prepared.w2_bias_EH,
            )
        except (TypeError, ValueError) as failure:
            try:
                check_batch_matches_weights(batch, prepared)
            except (TypeError, ValueError) as explained:
                raise explained from failure
            raise

    def _fp8_expert_mlp(
        self,
        batch: ExpertBatch,
        prepared: CuteDSLFP8Weights,
        row_scale_M: torch.Tensor | None,
        row_tokens_M: torch.Tensor | None = None,
        out_TH: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The FP8 expert MLP: the rows quantized per 128 columns (unless the batch holds FP8
        rows already), gate-up (its output quantized per 64 columns in its epilogue), down to
        bf16 (added into out_TH's token rows with row_tokens_M, as __call__ says)."""
        batch = batch.materialized()  # the FP8 kernels quantize batch rows
        rows_MH = batch.rows_MH
        check_batch_matches_weights(batch, prepared, same_dtype=False)
        if batch.row_scales_GM is None and rows_MH.dtype != torch.bfloat16:
            raise TypeError(f"the FP8 kernels take bf16 or FP8 batch rows, got {rows_MH.dtype}")
        memo = (
            "fp8",
            batch.capacity,
            batch.is_masked,
            batch.typical_rows,
            batch.valid_rows,
            batch.offsets_published,
            rows_MH.get_device(),
            prepared.w2_EHI.shape,
            row_scale_M is None,
            row_tokens_M is None,
            prepared.swiglu,
        )
        rows = self._fp8_rows(batch)
        launchers = self._launchers.get(memo)
        if launchers is None:
            launchers = self._launchers[memo] = self._bind_fp8(
                batch, rows[0], prepared, row_scale_M, row_tokens_M=row_tokens_M
            )
        return self._launch_fp8(
            launchers, rows, batch, prepared, row_scale_M, row_tokens_M=row_tokens_M, out_TH=out_TH
        )

    @staticmethod
    def _fp8_rows(batch: ExpertBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's e4m3 rows and their scales: as the batch holds them, or quantized here
        (one scale per row and 128 columns)."""
        from megamoe_kernels import quantize_rows

        if batch.row_scales_GM is not None:
            return batch.rows_MH, batch.row_scales_GM
        return quantize_rows(batch.rows_MH)

    def _bind_fp8(
        self,
        batch: ExpertBatch,
        rows_q: torch.Tensor,
        prepared: CuteDSLFP8Weights,
        row_scale_M: torch.Tensor | None,
        *,
        tuned: Mapping[str, GemmKnobs] | None = None,
        row_tokens_M: torch.Tensor | None = None,
    ) -> tuple[GemmLauncher, GemmLauncher]:
        """The FP8 gate-up and down GEMM's launchers for the batch's class, on its e4m3 rows
        `rows_q` (compiled here on first use); `tuned`: knobs for some ops in place of the
        looked-up ones; `row_tokens_M`: a down GEMM that adds its rows into their tokens'
        rows."""
        gate_up_knobs, down_knobs = self._knob_arguments(batch, prepared, tuned)
        gate_up = gate_up_fp8_launcher(
            rows_q,
            batch.expert_offsets,
            prepared.w13,
            valid_rows=batch.valid_rows,
            expert_counts=batch.expert_counts,
            offsets_published=batch.offsets_published,
            swiglu=prepared.swiglu,
            **gate_up_knobs,
        )
        intermediate = prepared.intermediate_size
        # the down GEMM reads the gate-up's output in the scale groups it writes (64 or 128
        # columns: its tiles decide)
        down = down_fp8_launcher(
            rows_q.new_empty((rows_q.shape[0], intermediate)),
            batch.expert_offsets,
            prepared.w2_EHI,
            x_group=gate_up.out_group,
            row_scale_M=row_scale_M,
            valid_rows=batch.valid_rows,
            expert_counts=batch.expert_counts,
            row_source_M=row_tokens_M,
            **down_knobs,
        )
        return gate_up, down

    @staticmethod
    def _launch_fp8(
        launchers: tuple[GemmLauncher, GemmLauncher],
        rows: tuple[torch.Tensor, torch.Tensor],
        batch: ExpertBatch,
        prepared: CuteDSLFP8Weights,
        row_scale_M: torch.Tensor | None,
        *,
        row_tokens_M: torch.Tensor | None = None,
        out_TH: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The two FP8 GEMMs on the batch's e4m3 rows and scales (`rows`)."""
        gate_up, down = launchers
        rows_q, rows_scales = rows
        offsets, counts = batch.expert_offsets, batch.expert_counts
        hidden_q, hidden_scales = gate_up(
            rows_q,
            offsets,
            prepared.w13,
            x_scales=rows_scales,
            w_scales=prepared.w13_scales,
            expert_counts=counts,
        )
        return down(
            hidden_q,
            offsets,
            prepared.w2_EHI,
            row_scale_M=row_scale_M,
            out=out_TH,
            x_scales=hidden_scales,
            w_scales=prepared.w2_scales,
            row_source_M=row_tokens_M,
            expert_counts=counts,
        )
