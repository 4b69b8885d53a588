"""The drop/shim boundary: only megamoe_kernels/shim/ imports megamoe_kernels/drop/, and the drop
imports nothing of megamoe or torch (only cutlass, cuda, nvshmem, the standard library, itself).

The check reads every .py of the three packages (src and tests), of the cross-package tests, of
scripts/ and of the top level with `ast`, so an import hidden in a function or made through
importlib by string counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from megamoe_kernels.drop_scan import (
    DROP_PACKAGE,
    drop_import_problems,
    imported_modules,
    is_within,
    parse_drop,
)

REPOSITORY = Path(__file__).resolve().parents[3]
KERNELS_SOURCE = REPOSITORY / "packages" / "megamoe-kernels" / "src" / "megamoe_kernels"
SHIM_DIR = KERNELS_SOURCE / "shim"
DROP_DIR = KERNELS_SOURCE / "drop"


def drop_imports(source: str, *, module_name: str, is_package: bool = False) -> list[str]:
    """The imports of megamoe_kernels.drop in `source`, as "line N: name"."""
    tree = ast.parse(source)
    return [
        f"line {imported.line}: {imported.name}"
        for imported in imported_modules(tree, module_name=module_name, is_package=is_package)
        if is_within(imported.name, DROP_PACKAGE)
    ]


def checked_files() -> list[Path]:
    """Every .py of packages/*/src, packages/*/tests, tests/, scripts/ and the top level."""
    roots = [REPOSITORY / "tests", REPOSITORY / "scripts"]
    for package in sorted((REPOSITORY / "packages").iterdir()):
        roots += [package / "src", package / "tests"]
    files = sorted(REPOSITORY.glob("*.py"))  # noxfile.py
    for root in roots:
        files += [path for path in sorted(root.rglob("*.py")) if "__pycache__" not in path.parts]
    return files


def module_identity(path: Path) -> tuple[str, bool]:
    """(dotted module name, is a package) of a file, as relative imports in it resolve."""
    source_root = next((parent for parent in path.parents if parent.name == "src"), None)
    relative = path.relative_to(source_root or REPOSITORY).with_suffix("")
    parts = list(relative.parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def test_no_module_outside_the_shim_imports_the_drop():
    files = checked_files()
    assert KERNELS_SOURCE / "__init__.py" in files and Path(__file__) in files
    violations = []
    for path in files:
        if SHIM_DIR in path.parents or DROP_DIR in path.parents:
            continue  # the shim may; the drop's imports of itself are checked below
        module_name, is_package = module_identity(path)
        for found in drop_imports(path.read_text(), module_name=module_name, is_package=is_package):
            violations.append(f"{path.relative_to(REPOSITORY)}: {found}")
    assert not violations, (
        "only megamoe_kernels/shim/ may import megamoe_kernels.drop; import what you need from "
        "megamoe_kernels (or megamoe_kernels.shim) instead:\n" + "\n".join(violations)
    )


def test_the_drop_imports_only_cutlass_cuda_nvshmem_stdlib_and_itself():
    parsed = parse_drop(DROP_DIR)
    assert not parsed.parse_errors, parsed.parse_errors
    problems = drop_import_problems(parsed)
    assert not problems, "\n".join(problems)


# The checker itself, on synthetic sources.

OUTSIDE = "megamoe_runtime.experts.cutedsl"  # a module of another package
KERNELS_MODULE = "megamoe_kernels.api"  # a module of megamoe_kernels beside drop/ and shim/


@pytest.mark.parametrize(
    ("source", "module_name", "is_package"),
    [
        ("import megamoe_kernels.drop", OUTSIDE, False),
        ("import megamoe_kernels.drop.gemm as gemm", OUTSIDE, False),
        ("from megamoe_kernels.drop import gemm", OUTSIDE, False),
        ("from megamoe_kernels.drop.gemm import Kernel", OUTSIDE, False),
        ("from megamoe_kernels import drop", OUTSIDE, False),
        ("from megamoe_kernels import reference, drop as kernels", OUTSIDE, False),
        ("from megamoe_kernels.drop import *", OUTSIDE, False),
        ("def build():\n    from megamoe_kernels.drop import gemm", OUTSIDE, False),
        ("from .drop import gemm", KERNELS_MODULE, False),
        ("from . import drop", KERNELS_MODULE, False),
        ("from . import drop", "megamoe_kernels", True),
        ("from .drop.gemm import Kernel", "megamoe_kernels", True),
        ("from ..drop import gemm", "megamoe_kernels.compat.loader", False),
        ("from .. import drop", "megamoe_kernels.compat", True),
        ("import importlib\nimportlib.import_module('megamoe_kernels.drop.gemm')", OUTSIDE, False),
        (
            "from importlib import import_module\nimport_module('megamoe_kernels.drop')",
            OUTSIDE,
            False,
        ),
        ("import importlib\nimportlib.import_module('.drop', 'megamoe_kernels')", OUTSIDE, False),
        (
            "import importlib\nimportlib.import_module(name='.drop', package='megamoe_kernels')",
            OUTSIDE,
            False,
        ),
        (
            "import importlib\nimportlib.import_module('.drop.gemm', __package__)",
            KERNELS_MODULE,
            False,
        ),
        ("__import__('megamoe_kernels.drop.gemm')", OUTSIDE, False),
        ("__import__('megamoe_kernels', globals(), locals(), ['drop'])", OUTSIDE, False),
        ("__import__('megamoe_kernels', fromlist=('reference', 'drop'))", OUTSIDE, False),
        ("__import__('drop', globals(), None, [], 1)", "megamoe_kernels", True),
    ],
)
def test_every_form_of_importing_the_drop_is_caught(source, module_name, is_package):
    assert drop_imports(source, module_name=module_name, is_package=is_package)


@pytest.mark.parametrize(
    ("source", "module_name", "is_package"),
    [
        ("import megamoe_kernels", OUTSIDE, False),
        ("from megamoe_kernels import reference", OUTSIDE, False),
        ("from megamoe_kernels.shim import grouped_gemm", OUTSIDE, False),
        ("import megamoe_kernels.dropout", OUTSIDE, False),
        ("from . import reference", "megamoe_kernels", True),
        ("from .shim.drop_adapter import launch", "megamoe_kernels", True),
        ("from .drop import helper", "megamoe_runtime.experts", True),  # another package's drop
        ("import importlib\nimportlib.import_module('megamoe_kernels.shim')", OUTSIDE, False),
        ("DROP = 'megamoe_kernels.drop'", OUTSIDE, False),  # naming it is not importing it
    ],
)
def test_imports_that_do_not_reach_the_drop_pass(source, module_name, is_package):
    assert drop_imports(source, module_name=module_name, is_package=is_package) == []


def test_the_line_of_each_violation_is_reported():
    source = "import os\n\n\ndef late():\n    import megamoe_kernels.drop.gemm\n"
    assert drop_imports(source, module_name=OUTSIDE) == ["line 5: megamoe_kernels.drop.gemm"]


@pytest.mark.parametrize(
    ("relative_path", "source", "expected"),
    [
        ("gemm.py", "import torch", "imports 'torch': a drop never imports torch"),
        ("gemm.py", "from torch.nn import functional", "a drop never imports torch"),
        ("gemm.py", "from megamoe_kernels import reference", "never imports megamoe_kernels"),
        ("gemm.py", "import megamoe_runtime.routing", "never imports megamoe_runtime"),
        ("gemm.py", "from .. import reference", "'megamoe_kernels.reference'"),
        ("ep/put.py", "from ... import reference", "'megamoe_kernels.reference'"),
        ("ep/put.py", "from .... import anything", "reaching above the drop's package"),
        ("gemm.py", "import importlib\nimportlib.import_module('torch')", "imports 'torch'"),
        ("gemm.py", "def f():\n    import numpy as np", "imports 'numpy': a drop imports only"),
    ],
)
def test_forbidden_drop_imports_are_caught(tmp_path, relative_path, source, expected):
    (tmp_path / relative_path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / relative_path).write_text(source + "\n")
    problems = drop_import_problems(parse_drop(tmp_path))
    assert len(problems) == 1 and expected in problems[0], problems
    assert problems[0].startswith(f"drop/{relative_path}:")


def test_allowed_drop_imports_pass(tmp_path):
    sources = {
        "__init__.py": "from .gemm import Kernel\nfrom . import layout\n",
        "gemm.py": (
            "from __future__ import annotations\nimport math\nimport cutlass\n"
            "import cutlass.cute as cute\nfrom cutlass.cute.nvgpu import cpasync, warpgroup\n"
            "import cuda.bindings.driver as cuda\nfrom .layout import BLOCK\n"
        ),
        "layout.py": "import functools\nBLOCK = 8\n",
        "ep/__init__.py": "from .put import put_rows\n",
        "ep/put.py": "import nvshmem.core\nfrom ..layout import BLOCK\nfrom .. import gemm\n",
    }
    for relative, text in sources.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    assert drop_import_problems(parse_drop(tmp_path)) == []
