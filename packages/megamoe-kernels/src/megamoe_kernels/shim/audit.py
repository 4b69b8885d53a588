"""The audit table of drop symbols the shim relies on, and a static audit of a drop against it.

`drop/` holds kernel sources verbatim as a kernel team hands them over; `shim/` is the only code
that imports them. Before a new drop replaces the old one (`python -m megamoe_kernels.resync`,
which also checks the drop's imports), `audit_drop` reads it with `ast`, never importing it, and
checks that every symbol in `AUDIT_TABLE` still exists with the kind and parameters the shim
relies on. It also lists the drop's kernels that the table does not use (reported, accepted).

How to add an entry (one per drop symbol the shim touches; keep them grouped per drop module):

    DropSymbol(
        module="grouped_gemm",                # drop/grouped_gemm.py; "ep.dispatch" is
                                              # drop/ep/dispatch.py, "__init__" drop/__init__.py
        name="GroupedGemmKernel.__call__",    # a top-level name, or Class.method / Class.CONSTANT
        kind="function",                      # "class" | "function" | "constant"
        parameters=("a", "b", "c", "stream"), # what the shim passes; None: the shim never calls it
        passed_as="positional",               # "keyword" (default) | "positional"
    )

`parameters` of a class are its constructor's (`__init__`, a dataclass's fields, or an __init__
inherited from a drop class); `self`/`cls` are never listed. With `passed_as="keyword"` each name
must still exist and accept a keyword; with `"positional"` the drop's leading positional
parameters must be exactly these names in this order (what `cute.compile(obj, *args)` and a
compiled kernel's call need). Either way a parameter the drop now requires and the shim does not
pass is a failure. A symbol re-exported by a drop module (`from .gemm import Kernel`) is followed
to its definition.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megamoe_kernels.drop_scan import (
    DROP_DIR,
    DropLookup,
    ParsedDrop,
    Signature,
    decorator_names,
    function_signature,
    is_bound_method,
    kind_of,
    parse_drop,
    top_level_bindings,
)
from megamoe_kernels.shim import ep

SymbolKind = Literal["class", "function", "constant"]
PassedAs = Literal["keyword", "positional"]
SYMBOL_KINDS: tuple[str, ...] = ("class", "function", "constant")
PASSED_AS: tuple[str, ...] = ("keyword", "positional")


@dataclass(frozen=True)
class DropSymbol:
    """One drop symbol the shim uses; see the module docstring for the format."""

    module: str
    name: str
    kind: SymbolKind
    parameters: tuple[str, ...] | None = None
    passed_as: PassedAs = "keyword"

    def __post_init__(self) -> None:
        for label, dotted in (("module", self.module), ("name", self.name)):
            if not dotted or not all(part.isidentifier() for part in dotted.split(".")):
                raise ValueError(
                    f"DropSymbol {label}={dotted!r} is not a dotted Python name; "
                    'expected e.g. module="grouped_gemm", name="GroupedGemmKernel.__call__"'
                )
        if self.kind not in SYMBOL_KINDS:
            raise ValueError(f"DropSymbol kind={self.kind!r}; accepted kinds are {SYMBOL_KINDS}")
        if self.passed_as not in PASSED_AS:
            raise ValueError(f"DropSymbol passed_as={self.passed_as!r}; accepted: {PASSED_AS}")
        if self.kind == "constant" and self.parameters is not None:
            raise ValueError(
                f"DropSymbol {self.module}.{self.name} is a constant but lists "
                f"parameters={self.parameters!r}; a constant takes parameters=None"
            )

    @property
    def label(self) -> str:
        return f"{self.module}.{self.name} ({self.kind})"


# Every drop symbol the shim uses. Kernel engineers: add yours here when the shim starts using it.
AUDIT_TABLE: tuple[DropSymbol, ...] = (
    # shim/expert_gemm.py: the grouped GEMM (gate-up + SwiGLU, down + row scale, both with an
    # optional per-expert bias; the clamped SwiGLU's constants)
    DropSymbol(
        "expert_gemm_sm90",
        "ExpertGroupedGemmSm90",
        "class",
        parameters=(
            "tile_rows",
            "tile_cols",
            "stages",
            "swap_ab",
            "swiglu",
            "row_scale",
            "rows_fastest",
            "num_ctas",
            "pingpong",
            "cluster_rows",
            "split_k",
            "min_valid_rows",
            "max_valid_rows",
            "weights_before_wait",
            "polls_offsets",
            "l2_prefetch_ctas",
            "dynamic_schedule",
            "scale_group",
            "out_scale_group",
            "gather_rows",
            "reduce_out",
            "bias",
            "swiglu_limit",
            "swiglu_alpha",
            "swiglu_up_offset",
            "swiglu_gate_softcap",
            "swiglu_up_softcap",
            "swiglu_gate_cubic",
            "prefetch_weight_scales",
        ),
    ),
    DropSymbol(
        "expert_gemm_sm90",
        "ExpertGroupedGemmSm90.__call__",
        "function",
        parameters=(
            "mX",
            "mW",
            "mOut",
            "mOffsets",
            "mRowScale",
            "mPartials",
            "mArrivals",
            "mUnitCounter",
            "mXScales",
            "mWScales",
            "mOutScales",
            "mRowSource",
            "mExpertCounts",
            "mBias",
            "stream",
        ),
        passed_as="positional",  # shim/ffi_launch.py calls kernel(mX, mW, ..., stream)
    ),
    # shim/expert_gemm.py: the gate/up weight interleave
    DropSymbol("gate_up_layout", "GATE_UP_BLOCK", "constant"),
    DropSymbol(
        "gate_up_layout",
        "interleaved_source_row",
        "function",
        parameters=("transformed_row", "intermediate_size"),
        passed_as="positional",
    ),
    # shim/knobs.py: shared-memory budget of the knob validity rule
    DropSymbol("tiling", "TILE_K", "constant"),
    DropSymbol("tiling", "FP8_TILE_K", "constant"),
    DropSymbol("tiling", "TILE_K_BYTES", "constant"),
    # shim/fp8.py and shim/knobs.py: the FP8 block-scaling recipe
    DropSymbol("fp8_scaling", "E4M3_MAX", "constant"),
    DropSymbol("fp8_scaling", "E4M3_MAX_RECIPROCAL", "constant"),
    DropSymbol("fp8_scaling", "AMAX_FLOOR", "constant"),
    DropSymbol("fp8_scaling", "WEIGHT_BLOCK", "constant"),
    DropSymbol("fp8_scaling", "ACTIVATION_GROUP", "constant"),
    DropSymbol("fp8_scaling", "INTERMEDIATE_GROUP", "constant"),
    DropSymbol("fp8_scaling", "WIDE_INTERMEDIATE_GROUP", "constant"),
    DropSymbol("tiling", "SMEM_CAPACITY_BYTES", "constant"),
    DropSymbol("tiling", "SMEM_RESERVED_BYTES", "constant"),
    DropSymbol("tiling", "EPILOGUE_ROW_PAD", "constant"),
    # shim/knobs.py: the FP8 tiles' column slices (the products per thread they keep)
    DropSymbol("tiling", "fp8_column_slices", "function", parameters=("mma_n", "swap_ab")),
    # shim/ep.py: expert-parallel dispatch and combine; each launcher's entry comes from its
    # declaration there (per-call arguments, the EpParams, compile-time constants, the stream)
    DropSymbol("ep_sync", "EpParams", "class", parameters=ep.params_fields()),
    *(
        DropSymbol(module, function, "function", parameters=parameters, passed_as="positional")
        for module, function, parameters in ep.audit_entries()
    ),
    DropSymbol("ep_place", "PLACE_MAX_EXPERTS", "constant"),
    DropSymbol("ep_place", "scratch_words", "function", parameters=("num_experts", "world")),
    DropSymbol("ep_dispatch_small", "SMALL_MAX_PAIRS", "constant"),
    DropSymbol("ep_dispatch_small", "SMALL_MAX_LOCAL_EXPERTS", "constant"),
    DropSymbol("ep_dispatch_small", "SMALL_MAX_RANKS", "constant"),
    DropSymbol("ep_dispatch_small", "SMALL_SCRATCH_WORDS", "constant"),
    DropSymbol("ep_dispatch_small", "ids_words", "function", parameters=("max_tokens", "top_k")),
    DropSymbol("ep_dispatch_small", "ids_rows", "function", parameters=("world",)),
    # shim/ep.py: the buffer, phase and status layout the runtime allocates for
    *(
        DropSymbol("ep_sync", constant, "constant")
        for constant in (
            "PHASE_COUNTS",
            "PHASE_ROWS",
            "PHASE_RETURNED",
            "NUM_PHASES",
            "STATUS_WORDS",
            "BUFFER_COUNTS",
            "BUFFER_SIGNALS",
            "BUFFER_ROWS",
            "BUFFER_ROW_SOURCES",
            "BUFFER_RETURNED",
            "BUFFER_STAGED",
            "BUFFER_PAIR_ROWS",
            "BUFFER_PAIR_WEIGHTS",
            "BUFFER_PARTIALS",
            "BUFFER_ARRIVED",
            "BUFFER_IDS",
            "BUFFER_ROW_SCALES",
            "BUFFER_STAGED_SCALES",
            "BUFFER_RETURNED_SCALES",
            "BUFFER_PARTIAL_SCALES",
            "NUM_BUFFERS",
        )
    ),
    DropSymbol(
        "local_route",
        "route_and_place",
        "function",
        parameters=(
            "mLogits",
            "mBias",
            "mSharedGate",
            "mGivenIds",
            "mGivenWeights",
            "mX",
            "mTopkIds",
            "mTopkWeights",
            "mRowOfPair",
            "mExpertOffsets",
            "mRows",
            "mRowScales",
            "mRowSource",
            "mRowWeights",
            "mZeroRows",
            "mScratch",
            "mStatus",
            "mTokenCount",
            "rule",
            "unroll",
            "copy_by_token",
            "timeout_ns",
            "one_cta_tokens",
            "shared_experts",
            "weights_on_input",
            "split_tokens",
            "cta_tokens",
            "publish_offsets",
            "sms",
            "stream",
        ),
        passed_as="positional",
    ),
    DropSymbol(
        "local_route",
        "route_tokens",
        "function",
        parameters=(
            "mLogits",
            "mBias",
            "mTopkIds",
            "mTopkWeights",
            "rule",
            "stream",
        ),
        passed_as="positional",
    ),
    DropSymbol(
        "local_route",
        "RouteRule",
        "class",
        parameters=(
            "num_experts",
            "top_k",
            "scoring",
            "renormalize",
            "num_groups",
            "top_groups",
            "group_by_max",
            "choice_on_logits",
            "dropped_score",
            "scaling",
            "sparsemixer_eps",
        ),
    ),
    DropSymbol("local_route", "scratch_words", "function", parameters=("num_experts",)),
    DropSymbol("local_route", "ROUTE_MAX_EXPERTS", "constant"),
    DropSymbol("local_route", "ROUTE_MAX_TOP_K", "constant"),
    DropSymbol("local_route", "ROUTE_THREADS", "constant"),
    DropSymbol("local_route", "route_ctas_per_sm", "function", parameters=("experts", "quantizes")),
    DropSymbol("local_combine", "COMBINE_THREADS", "constant"),
    DropSymbol("local_combine", "combine_ctas_per_sm", "function", parameters=("top_k",)),
    DropSymbol(
        "local_combine",
        "combine_pairs",
        "function",
        parameters=(
            "mExpertOut",
            "mRowOfPair",
            "mWeights",
            "mAddend",
            "mY",
            "mTokenCount",
            "top_k",
            "sms",
            "stream",
        ),
        passed_as="positional",
    ),
    # shim/router_logits.py: the decode router's logits
    DropSymbol(
        "local_router",
        "router_logits",
        "function",
        parameters=(
            "mX",
            "mWeight",
            "mBias",
            "mLogits",
            "hidden_size",
            "token_block",
            "expert_block",
            "early_dependents",
            "stream",
        ),
        passed_as="positional",
    ),
    DropSymbol("local_router", "ROUTER_MAX_TOKEN_BLOCK", "constant"),
    DropSymbol("local_router", "ROUTER_MAX_EXPERT_BLOCK", "constant"),
)


# ---------------------------------------------------------------------------------------------
# The audit


def parameter_problems(entry: DropSymbol, signature: Signature) -> list[str]:
    """How `signature` breaks the calls the shim makes as `entry` describes them."""
    assert entry.parameters is not None
    problems = []
    by_name = {parameter.name: parameter for parameter in signature.parameters}
    relied_on = set(entry.parameters)
    if entry.passed_as == "positional":
        positional = [parameter.name for parameter in signature.parameters if parameter.positional]
        for index, expected in enumerate(entry.parameters):
            if index >= len(positional):
                if not signature.var_positional:
                    problems.append(f"takes no parameter at position {index} ({expected!r})")
            elif positional[index] != expected:
                problems.append(
                    f"position {index} is {positional[index]!r} now, the shim passes "
                    f"{expected!r} there (renamed or reordered)"
                )
    else:
        for expected in entry.parameters:
            parameter = by_name.get(expected)
            if parameter is None:
                problems.append(f"parameter {expected!r} is gone (renamed?)")
            elif not parameter.keyword:
                problems.append(f"parameter {expected!r} is positional-only now")
    if entry.passed_as == "positional":
        covered = set(positional[: len(entry.parameters)])
    else:
        covered = relied_on
    for parameter in signature.parameters:
        if parameter.required and parameter.name not in covered:
            problems.append(
                f"newly requires {parameter.name!r} (no default), which the shim does not pass"
            )
    if problems:
        problems.append(f"the drop's signature is {signature}; the shim passes {entry.parameters}")
    return problems


def is_kernel_like(statement: ast.stmt) -> bool:
    """What the unused-kernel report lists: public classes and @cute.jit/@cute.kernel functions."""
    if isinstance(statement, ast.ClassDef):
        return not statement.name.startswith("_")
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
        public = not statement.name.startswith("_")
        return public and bool({"jit", "kernel"} & decorator_names(statement))
    return False


@dataclass(frozen=True)
class AuditReport:
    """What a drop lacks for the shim (`problems`) and has that the shim skips (`unused`)."""

    drop_dir: Path
    entries_checked: int
    problems: tuple[str, ...]
    unused: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.problems

    def format(self) -> str:
        lines = [f"audit of {self.drop_dir} against {self.entries_checked} shim table entries:"]
        if self.problems:
            lines.append(f"  FAILED: {len(self.problems)} problem(s)")
            lines += [f"  - {problem}" for problem in self.problems]
            lines.append(
                "  fix: adapt shim/ to the new drop and update its entries in "
                "megamoe_kernels/shim/audit.py, or ask the kernel team for a compatible drop"
            )
        else:
            lines.append("  ok: every symbol the shim uses is there, with compatible parameters")
        if self.unused:
            lines.append(f"  not used by the shim (accepted): {len(self.unused)}")
            lines += [f"  - {symbol}" for symbol in self.unused]
        return "\n".join(lines)


def audit_drop(
    drop_dir: Path = DROP_DIR,
    *,
    table: tuple[DropSymbol, ...] = AUDIT_TABLE,
    parsed: ParsedDrop | None = None,
) -> AuditReport:
    """Checks, without importing anything, that `drop_dir` has every symbol `table` relies on."""
    parsed = parsed if parsed is not None else parse_drop(drop_dir)
    lookup = DropLookup(parsed)
    problems = []
    for entry in table:
        found = lookup.find(entry.module, entry.name)
        if isinstance(found, str):
            problems.append(f"{entry.label}: {found}")
            continue
        kind = kind_of(found.statement)
        if kind != entry.kind:
            problems.append(f"{entry.label}: is a {kind} now, the shim uses it as a {entry.kind}")
            continue
        if entry.parameters is None:
            continue
        if isinstance(found.statement, ast.ClassDef):
            signature = lookup.constructor_signature(found)
        else:
            assert isinstance(found.statement, ast.FunctionDef | ast.AsyncFunctionDef)
            bound = found.owner is not None and is_bound_method(found.statement)
            signature = function_signature(found.statement, bound=bound)
        if isinstance(signature, str):
            problems.append(f"{entry.label}: {signature}")
            continue
        problems += [
            f"{entry.label}: {problem}" for problem in parameter_problems(entry, signature)
        ]

    used = {(entry.module, entry.name.split(".")[0]) for entry in table}
    unused = []
    for module, tree in sorted(parsed.modules.items()):
        for name, statement in top_level_bindings(tree.body).items():
            if (module, name) not in used and is_kernel_like(statement):
                unused.append(f"{parsed.where(module)}: {name} ({kind_of(statement)})")
    return AuditReport(
        drop_dir=Path(drop_dir),
        entries_checked=len(table),
        problems=tuple(problems),
        unused=tuple(unused),
    )
