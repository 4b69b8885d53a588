"""Reading a kernel drop without importing it: its files, their syntax trees, their imports.

A drop (`megamoe_kernels/drop/`, or a folder about to replace it) is read with `ast` only, so a
broken or hostile drop cannot run code here. The shim's audit (`shim/audit.py`), the resync
(`resync.py`) and the boundary test build on these functions.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DROP_DIR = Path(__file__).resolve().parent / "drop"
DROP_PACKAGE = "megamoe_kernels.drop"
# Top-level packages a drop may import besides the standard library and its own modules.
ALLOWED_DROP_IMPORT_ROOTS = frozenset({"cutlass", "cuda", "nvshmem"})


# ---------------------------------------------------------------------------------------------
# Reading a drop


@dataclass(frozen=True)
class ParsedDrop:
    """The drop's Python modules, parsed: module name inside the drop -> syntax tree."""

    drop_dir: Path
    modules: dict[str, ast.Module]
    paths: dict[str, Path]  # module name -> file, relative to the drop
    parse_errors: tuple[str, ...]

    def where(self, module: str) -> str:
        """The module's file as a person finds it: drop/ep/dispatch.py."""
        return f"drop/{self.paths[module].as_posix()}"

    def import_context(self, module: str) -> tuple[str, bool]:
        """(dotted name once installed, is a package): what relative imports resolve against."""
        dotted = DROP_PACKAGE if module == "__init__" else f"{DROP_PACKAGE}.{module}"
        return dotted, self.paths[module].name == "__init__.py"


def list_drop_files(drop_dir: Path) -> list[Path]:
    """Every file of a drop, relative to it, sorted by path text; caches and hidden folders
    (.git) left out."""
    files = []
    for path in Path(drop_dir).rglob("*"):
        relative = path.relative_to(drop_dir)
        in_skipped_folder = any(
            part == "__pycache__" or part.startswith(".") for part in relative.parts[:-1]
        )
        if in_skipped_folder or path.is_dir() or path.suffix in (".pyc", ".pyo"):
            continue
        files.append(relative)
    return sorted(files, key=lambda relative: relative.as_posix())


def drop_module_name(relative_path: Path) -> str:
    """`gemm.py` -> "gemm", `ep/dispatch.py` -> "ep.dispatch", `ep/__init__.py` -> "ep"."""
    parts = list(relative_path.with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def parse_drop(drop_dir: Path) -> ParsedDrop:
    """Parses every .py of a drop without importing any; unparsable files are listed, not fatal."""
    modules: dict[str, ast.Module] = {}
    paths: dict[str, Path] = {}
    errors = []
    for relative in list_drop_files(drop_dir):
        if relative.suffix != ".py":
            continue
        try:
            tree = ast.parse((drop_dir / relative).read_bytes(), filename=str(relative))
        except SyntaxError as error:
            errors.append(f"drop/{relative.as_posix()}: line {error.lineno}: {error.msg}")
            continue
        except ValueError as error:  # undecodable bytes, null bytes
            errors.append(f"drop/{relative.as_posix()}: cannot be read as Python source: {error}")
            continue
        modules[drop_module_name(relative)] = tree
        paths[drop_module_name(relative)] = relative
    return ParsedDrop(Path(drop_dir), modules=modules, paths=paths, parse_errors=tuple(errors))


def module_file_hint(module: str) -> str:
    if module == "__init__":
        return "drop/__init__.py"
    return f"drop/{module.replace('.', '/')}.py"


def resolve_relative(name: str, *, level: int, package: str) -> str | None:
    """The absolute name of a relative import made from `package`; None above the top level."""
    if level == 0:
        return name
    package_parts = package.split(".") if package else []
    if level - 1 >= len(package_parts):
        return None
    base = package_parts[: len(package_parts) - (level - 1)]
    return ".".join([*base, name] if name else base)


def is_within(name: str, package: str) -> bool:
    """Whether dotted `name` is `package` or inside it."""
    return name == package or name.startswith(package + ".")


def call_name(func: ast.expr) -> str | None:
    """The called name: `f` for `f(...)` and `mod.f(...)`."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


# ---------------------------------------------------------------------------------------------
# Imports


@dataclass(frozen=True)
class ImportedModule:
    """One import in a source, as the absolute dotted name it reaches.

    `from pkg import name` is recorded as "pkg.name", since `name` may be a submodule. A relative
    import reaching above the top-level package has `resolved=False` and keeps its dots.
    """

    name: str
    line: int
    resolved: bool = True


def _string_argument(call: ast.Call, *, position: int, keyword: str) -> ast.expr | None:
    if len(call.args) > position:
        return call.args[position]
    return next((item.value for item in call.keywords if item.arg == keyword), None)


def _constant_strings(node: ast.expr | None) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [item for element in node.elts for item in _constant_strings(element)]
    return []


def _dynamic_imports(call: ast.Call, *, package: str) -> Iterator[tuple[str, int]]:
    """(name, level) pairs for importlib.import_module / __import__ with constant strings."""
    function = call_name(call.func)
    if function == "import_module":
        anchor = _string_argument(call, position=1, keyword="package")
        anchor_names = _constant_strings(anchor)
        for name in _constant_strings(_string_argument(call, position=0, keyword="name")):
            level = len(name) - len(name.lstrip("."))
            # A non-constant anchor (`__package__`, `__name__`) is the importing module's package.
            relative_to = anchor_names[0] if anchor_names else package
            resolved = resolve_relative(name[level:], level=level, package=relative_to)
            yield (resolved if resolved is not None else name), 0
    elif function == "__import__":
        level_node = _string_argument(call, position=4, keyword="level")
        level = level_node.value if isinstance(level_node, ast.Constant) else 0
        level = level if isinstance(level, int) else 0
        fromlist = _constant_strings(_string_argument(call, position=3, keyword="fromlist"))
        for name in _constant_strings(_string_argument(call, position=0, keyword="name")):
            targets = [f"{name}.{item}" if name else item for item in fromlist] or [name]
            for target in targets:
                yield target, level


def imported_modules(
    tree: ast.Module, *, module_name: str, is_package: bool
) -> list[ImportedModule]:
    """Every import in a module, in any form, as absolute dotted names.

    `import a.b`, `from a import b`, relative `from ..a import b` (resolved against `module_name`)
    and `importlib.import_module("a")` / `__import__("a")` with constant strings, at any depth
    (inside functions too). Imports built from run-time strings cannot be seen statically.
    """
    package = module_name if is_package else module_name.rpartition(".")[0]
    found = []

    def record(name: str, *, level: int, line: int) -> None:
        resolved = resolve_relative(name, level=level, package=package)
        if resolved is None:
            found.append(ImportedModule("." * level + name, line, resolved=False))
        else:
            found.append(ImportedModule(resolved, line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                record(alias.name, level=0, line=node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            for alias in node.names:
                record(
                    f"{base}.{alias.name}" if base else alias.name,
                    level=node.level,
                    line=node.lineno,
                )
        elif isinstance(node, ast.Call):
            for name, level in _dynamic_imports(node, package=package):
                record(name, level=level, line=node.lineno)
    return found


def drop_import_problems(
    parsed: ParsedDrop, *, allowed_roots: frozenset[str] = ALLOWED_DROP_IMPORT_ROOTS
) -> list[str]:
    """Imports a drop may not make: anything but `allowed_roots`, the stdlib and the drop itself."""
    problems = []
    for module, tree in sorted(parsed.modules.items()):
        module_name, is_package = parsed.import_context(module)
        for imported in imported_modules(tree, module_name=module_name, is_package=is_package):
            root = imported.name.split(".")[0]
            if not imported.resolved:
                reason = "a relative import reaching above the drop's package"
            elif is_within(imported.name, DROP_PACKAGE):
                continue
            elif root.startswith("megamoe") or root == "torch":
                reason = f"a drop never imports {root}: the shim adapts the drop, not the reverse"
            elif root in allowed_roots or root in sys.stdlib_module_names:
                continue
            else:
                allowed = ", ".join(sorted(allowed_roots))
                reason = f"a drop imports only {allowed}, the standard library and itself"
            problems.append(
                f"{parsed.where(module)}:{imported.line}: imports {imported.name!r}: {reason}"
            )
    return problems
