"""The shim's audit table against drops: synthetic drops for each finding, and the real drop."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from megamoe_kernels.drop_scan import DROP_PACKAGE, is_within, parse_drop, resolve_relative
from megamoe_kernels.shim.audit import AUDIT_TABLE, DropSymbol, audit_drop

CHECKOUT_DROP_DIR = Path(__file__).resolve().parents[1] / "src" / "megamoe_kernels" / "drop"
CHECKOUT_SHIM_DIR = CHECKOUT_DROP_DIR.parent / "shim"

GEMM = """\
import cutlass.cute as cute

from .layout import BLOCK

TILE_ROWS: int = 128


class GroupedGemm:
    def __init__(self, tile_rows, tile_cols, *, stages=4):
        self.tile_rows = tile_rows

    @staticmethod
    def can_implement(tile_rows, tile_cols):
        return tile_rows % BLOCK == 0

    @cute.jit
    def __call__(self, mA, mB, mOut, stream):
        pass


class _Scheduler:
    pass


def helper(x):
    return x
"""
LAYOUT = """\
BLOCK = 8


def interleave(column, *, block=BLOCK):
    return column
"""
SYNTHETIC_DROP = {
    "__init__.py": "from .gemm import GroupedGemm\n",
    "gemm.py": GEMM,
    "layout.py": LAYOUT,
}
SYNTHETIC_TABLE = (
    DropSymbol("gemm", "GroupedGemm", "class", ("tile_rows", "tile_cols", "stages")),
    DropSymbol("gemm", "GroupedGemm.can_implement", "function", ("tile_rows", "tile_cols")),
    DropSymbol(
        "gemm", "GroupedGemm.__call__", "function", ("mA", "mB", "mOut", "stream"), "positional"
    ),
    DropSymbol("gemm", "TILE_ROWS", "constant"),
    DropSymbol("layout", "interleave", "function", ("column",)),
    DropSymbol("__init__", "GroupedGemm", "class", ("tile_rows", "tile_cols")),
)


def write_drop(folder: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)
    return folder


def audit_with(tmp_path: Path, *, replace: dict[str, tuple[str, str]] | None = None, **kwargs):
    """Audits the synthetic drop with `replace[file] = (old, new)` applied to its sources."""
    files = dict(SYNTHETIC_DROP)
    for relative, (old, new) in (replace or {}).items():
        assert old in files[relative], f"{old!r} not in the synthetic {relative}"
        files[relative] = files[relative].replace(old, new)
    return audit_drop(write_drop(tmp_path / "drop", files), table=SYNTHETIC_TABLE, **kwargs)


def test_a_compatible_drop_passes_and_lists_only_unused_kernel_like_symbols(tmp_path):
    report = audit_with(tmp_path)
    assert report.passed, report.format()
    assert report.entries_checked == len(SYNTHETIC_TABLE)
    # helper is a plain function and _Scheduler private: neither is a kernel the shim could use
    assert report.unused == ()


@pytest.mark.parametrize(
    ("replace", "expected"),
    [
        (
            {"layout.py": ("def interleave(", "def interleave_columns(")},
            "interleave is not defined",
        ),
        ({"gemm.py": ("TILE_ROWS: int = 128", "TILE_M = 128")}, "TILE_ROWS is not defined"),
        ({"gemm.py": ("    def can_implement(", "    def supports(")}, "no member can_implement"),
        ({"gemm.py": ("TILE_ROWS: int = 128", "def TILE_ROWS(): ...")}, "is a function now"),
        (
            {"layout.py": ("def interleave(column, *, block=BLOCK):", "class interleave:")},
            "a class now",
        ),
        (
            {"gemm.py": ("self, tile_rows, tile_cols,", "self, rows, tile_cols,")},
            "'tile_rows' is gone",
        ),
        ({"gemm.py": ("*, stages=4", "*, num_stages=4")}, "'stages' is gone"),
        ({"gemm.py": ("*, stages=4", "*, stages=4, cluster")}, "newly requires 'cluster'"),
        ({"layout.py": ("column, *,", "column, /, *,")}, "'column' is positional-only"),
        ({"gemm.py": ("self, mA, mB, mOut,", "self, mB, mA, mOut,")}, "position 0 is 'mB'"),
        ({"gemm.py": ("mOut, stream):", "mOut, mScale, stream):")}, "position 3 is 'mScale'"),
        ({"gemm.py": ("mOut, stream):", "mOut):")}, "no parameter at position 3"),
        ({"__init__.py": ("from .gemm import GroupedGemm", "")}, "not defined in drop/__init__.py"),
    ],
)
def test_each_incompatibility_is_reported_with_the_symbol_and_what_changed(
    tmp_path, replace, expected
):
    report = audit_with(tmp_path, replace=replace)
    assert not report.passed
    assert any(expected in problem for problem in report.problems), report.format()
    assert "FAILED" in report.format()


def test_a_symbol_now_imported_from_outside_the_drop_is_a_kind_change(tmp_path):
    replace = {
        "layout.py": (
            "def interleave(column, *, block=BLOCK):",
            "from math import floor as interleave\n\n\ndef unused(column, *, block=BLOCK):",
        )
    }
    report = audit_with(tmp_path, replace=replace)
    assert any(
        "is a name imported from another package now" in problem for problem in report.problems
    ), report.format()


@pytest.mark.parametrize(
    "replace",
    [
        {"gemm.py": ("*, stages=4", "*, stages=4, swap_ab=False")},  # a new optional knob
        {"gemm.py": ("mOut, stream):", "mOut, stream, mScale=None):")},  # an optional trailer
        {"layout.py": ("column, *,", "column, width=1, *,")},  # keyword-passed: order is free
        {"gemm.py": ("TILE_ROWS: int = 128", "TILE_ROWS = 64")},  # a constant's value is free
    ],
)
def test_changes_the_shim_does_not_depend_on_pass(tmp_path, replace):
    report = audit_with(tmp_path, replace=replace)
    assert report.passed, report.format()


def test_a_parameter_problem_shows_the_drops_new_signature_next_to_what_the_shim_passes(tmp_path):
    report = audit_with(tmp_path, replace={"gemm.py": ("*, stages=4", "*extra, num_stages=4")})
    assert (
        "gemm.GroupedGemm (class): the drop's signature is (tile_rows, tile_cols, *args, "
        "num_stages=...); the shim passes ('tile_rows', 'tile_cols', 'stages')"
    ) in report.problems


def test_missing_module_and_unparsable_module_are_named(tmp_path):
    drop = write_drop(tmp_path / "drop", {**SYNTHETIC_DROP, "layout.py": "def interleave(:\n"})
    (drop / "gemm.py").unlink()
    report = audit_drop(drop, table=SYNTHETIC_TABLE)
    text = report.format()
    assert "drop/gemm.py is missing" in text
    assert "drop/layout.py does not parse" in text
    assert parse_drop(drop).parse_errors[0].startswith("drop/layout.py: line 1")


def test_unused_kernels_are_reported_but_accepted(tmp_path):
    extra = """\
import cutlass.cute as cute


class FusedDown:
    def __init__(self, tile_rows):
        pass


@cute.kernel
def scatter_rows(mX):
    pass


def plain_helper():
    pass
"""
    drop = write_drop(tmp_path / "drop", {**SYNTHETIC_DROP, "down.py": extra})
    report = audit_drop(drop, table=SYNTHETIC_TABLE)
    assert report.passed
    assert report.unused == (
        "drop/down.py: FusedDown (class)",
        "drop/down.py: scatter_rows (function)",
    )
    assert "not used by the shim (accepted): 2" in report.format()


def test_constructors_from_dataclass_fields_and_drop_base_classes(tmp_path):
    source = """\
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tiling:
    rows: int
    cols: int = 128
    extra: list = field(default_factory=list)


class Base:
    def __init__(self, tiling, *, stages=2):
        pass


class Derived(Base):
    pass


class External(SomeCutlassBase):
    pass
"""
    drop = write_drop(tmp_path / "drop", {"knobs.py": source})
    passing = (
        DropSymbol("knobs", "Tiling", "class", ("rows",)),
        DropSymbol("knobs", "Derived", "class", ("tiling", "stages")),
        DropSymbol("knobs", "External", "class", None),  # not called: no constructor needed
    )
    assert audit_drop(drop, table=passing).passed
    failing = (
        DropSymbol("knobs", "Tiling", "class", ("cols",)),
        DropSymbol("knobs", "External", "class", ()),
    )
    problems = "\n".join(audit_drop(drop, table=failing).problems)
    assert "knobs.Tiling (class): newly requires 'rows'" in problems
    assert "knobs.External (class): class External inherits its constructor from" in problems


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"module": "gemm", "name": "Kernel", "kind": "kernel"}, "accepted kinds"),
        ({"module": "drop/gemm", "name": "Kernel", "kind": "class"}, "module='drop/gemm'"),
        ({"module": "gemm", "name": "", "kind": "class"}, "name=''"),
        ({"module": "gemm", "name": "BLOCK", "kind": "constant", "parameters": ()}, "constant"),
        ({"module": "gemm", "name": "f", "kind": "function", "passed_as": "both"}, "passed_as"),
    ],
)
def test_a_malformed_table_entry_says_what_is_accepted(arguments, message):
    with pytest.raises(ValueError, match=message):
        DropSymbol(**arguments)


def test_the_real_table_matches_the_current_drop():
    """Every symbol the shim uses is in the drop it ships with, with compatible parameters."""
    report = audit_drop(CHECKOUT_DROP_DIR)
    assert report.entries_checked == len(AUDIT_TABLE)
    assert report.passed, report.format()
    labels = [entry.label for entry in AUDIT_TABLE]
    assert len(labels) == len(set(labels)), "an entry is listed twice in AUDIT_TABLE"


def drop_symbols_used(
    source: str, *, module_name: str, drop_modules: set[str]
) -> set[tuple[str, str]]:
    """(drop module, top-level name) pairs a shim module uses: names imported from drop modules,
    and attributes read from drop modules it imports whole."""
    package = module_name.rpartition(".")[0]
    used = set()
    module_aliases = {}  # local name -> drop module
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            source_module = resolve_relative(node.module or "", level=node.level, package=package)
            if source_module is None or not is_within(source_module, DROP_PACKAGE):
                continue
            inner = source_module[len(DROP_PACKAGE) + 1 :]
            for alias in node.names:
                submodule = f"{inner}.{alias.name}" if inner else alias.name
                if submodule in drop_modules:
                    module_aliases[alias.asname or alias.name] = submodule
                else:
                    used.add((inner or "__init__", alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name.startswith(DROP_PACKAGE + "."):
                    module_aliases[alias.asname] = alias.name[len(DROP_PACKAGE) + 1 :]
    for node in ast.walk(ast.parse(source)):
        reads_a_drop_module = (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in module_aliases
        )
        if reads_a_drop_module:
            used.add((module_aliases[node.value.id], node.attr))
    return used


def test_drop_symbols_used_finds_imported_names_and_module_attributes():
    source = """\
from megamoe_kernels.drop.tiling import TILE_K, SMEM_BYTES as BYTES
from ..drop import gate_up_layout
import megamoe_kernels.drop.ep_put as put


def launch():
    from megamoe_kernels.drop.gemm import Kernel
    return Kernel, gate_up_layout.GATE_UP_BLOCK, put.put_rows, BYTES
"""
    used = drop_symbols_used(
        source,
        module_name="megamoe_kernels.shim.launch",
        drop_modules={"tiling", "gate_up_layout", "gemm", "ep_put"},
    )
    assert used == {
        ("tiling", "TILE_K"),
        ("tiling", "SMEM_BYTES"),
        ("gemm", "Kernel"),
        ("gate_up_layout", "GATE_UP_BLOCK"),
        ("ep_put", "put_rows"),
    }


def test_every_drop_symbol_the_shim_uses_has_a_table_entry():
    drop_modules = set(parse_drop(CHECKOUT_DROP_DIR).modules)
    in_table = {(entry.module, entry.name.split(".")[0]) for entry in AUDIT_TABLE}
    missing = []
    for path in sorted(CHECKOUT_SHIM_DIR.glob("*.py")):
        module_name = f"megamoe_kernels.shim.{path.stem}"
        used = drop_symbols_used(
            path.read_text(), module_name=module_name, drop_modules=drop_modules
        )
        missing += [f"shim/{path.name} uses drop {m}.{name}" for m, name in sorted(used - in_table)]
    assert not missing, (
        "add an entry to AUDIT_TABLE in megamoe_kernels/shim/audit.py for each:\n"
        + "\n".join(missing)
    )
