"""Reading a kernel drop without importing it: its files, imports, definitions and signatures.

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


# ---------------------------------------------------------------------------------------------
# Symbols and signatures


@dataclass(frozen=True)
class Parameter:
    name: str
    required: bool
    positional: bool  # can be passed by position
    keyword: bool  # can be passed by keyword


@dataclass(frozen=True)
class Signature:
    parameters: tuple[Parameter, ...]
    var_positional: bool = False
    var_keyword: bool = False

    def __str__(self) -> str:
        def shown(parameter: Parameter) -> str:
            return parameter.name if parameter.required else f"{parameter.name}=..."

        positional = [shown(p) for p in self.parameters if p.positional]
        keyword_only = [shown(p) for p in self.parameters if not p.positional]
        marker = ["*args"] if self.var_positional else ["*"] if keyword_only else []
        var_keyword = ["**kwargs"] if self.var_keyword else []
        return f"({', '.join([*positional, *marker, *keyword_only, *var_keyword])})"


def decorator_names(node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = call_name(target)
        if name:
            names.add(name)
    return names


def function_signature(node: ast.FunctionDef | ast.AsyncFunctionDef, *, bound: bool) -> Signature:
    """The signature as a caller sees it; `bound` drops the first parameter (self, cls)."""
    arguments = node.args
    positional = [*arguments.posonlyargs, *arguments.args]
    first_default = len(positional) - len(arguments.defaults)
    parameters = [
        Parameter(
            argument.arg,
            required=index < first_default,
            positional=True,
            keyword=index >= len(arguments.posonlyargs),
        )
        for index, argument in enumerate(positional)
    ]
    if bound and parameters:
        parameters.pop(0)
    parameters += [
        Parameter(argument.arg, required=default is None, positional=False, keyword=True)
        for argument, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
    ]
    return Signature(
        tuple(parameters),
        var_positional=arguments.vararg is not None,
        var_keyword=arguments.kwarg is not None,
    )


def is_bound_method(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return "staticmethod" not in decorator_names(node)


def _dataclass_signature(node: ast.ClassDef) -> Signature:
    parameters = []
    for statement in node.body:
        if not isinstance(statement, ast.AnnAssign) or not isinstance(statement.target, ast.Name):
            continue
        if "ClassVar" in ast.unparse(statement.annotation):
            continue
        value = statement.value
        has_default = value is not None and not (
            isinstance(value, ast.Call)
            and call_name(value.func) == "field"
            and not {"default", "default_factory"} & {item.arg for item in value.keywords}
        )
        parameters.append(Parameter(statement.target.id, not has_default, True, True))
    return Signature(tuple(parameters))


def top_level_bindings(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Names a module or class body binds -> the statement binding them (the last one wins).

    Looks into `if`/`try` blocks at that level too (`try: import x except ImportError: ...`).
    """
    bindings: dict[str, ast.stmt] = {}
    for statement in body:
        if isinstance(statement, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            bindings[statement.name] = statement
        elif isinstance(statement, ast.Assign | ast.AnnAssign):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            for target in targets:
                for name_node in ast.walk(target):
                    if isinstance(name_node, ast.Name):
                        bindings[name_node.id] = statement
        elif isinstance(statement, ast.Import | ast.ImportFrom):
            for alias in statement.names:
                bindings[alias.asname or alias.name.split(".")[0]] = statement
        elif isinstance(statement, ast.If):
            bindings.update(top_level_bindings(statement.body + statement.orelse))
        elif isinstance(statement, ast.Try):
            nested = statement.body + statement.orelse + statement.finalbody
            for handler in statement.handlers:
                nested += handler.body
            bindings.update(top_level_bindings(nested))
    return bindings


def kind_of(statement: ast.stmt) -> str:
    if isinstance(statement, ast.ClassDef):
        return "class"
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
        return "function"
    if isinstance(statement, ast.Assign | ast.AnnAssign):
        return "constant"
    return "name imported from another package"


@dataclass(frozen=True)
class Found:
    """Where a drop symbol is defined: its module and the statement defining it."""

    module: str
    statement: ast.stmt
    owner: ast.ClassDef | None  # the class holding it, for Class.member names


class DropLookup:
    """Finds drop symbols in a parsed drop, following re-exports between drop modules."""

    def __init__(self, parsed: ParsedDrop) -> None:
        self.parsed = parsed
        self._bindings = {
            module: top_level_bindings(tree.body) for module, tree in parsed.modules.items()
        }

    def find(self, module: str, name: str) -> Found | str:
        """The definition of `module.name`, or a sentence saying why it cannot be found."""
        return self._find(module, name.split("."), seen=set())

    def _find(self, module: str, parts: list[str], *, seen: set[tuple[str, str]]) -> Found | str:
        if module not in self.parsed.modules:
            unparsable = any(
                module_file_hint(module) in error for error in self.parsed.parse_errors
            )
            reason = "does not parse (see the validation above)" if unparsable else "is missing"
            return f"module {module_file_hint(module)} {reason}"
        if (module, parts[0]) in seen:
            return f"{'.'.join(parts)} is re-exported in a cycle"
        seen.add((module, parts[0]))
        statement = self._bindings[module].get(parts[0])
        if statement is None:
            return f"{parts[0]} is not defined in {self.parsed.where(module)}"
        if isinstance(statement, ast.ImportFrom):
            target = self._reexported_from(module, statement, parts[0])
            if target is not None:
                return self._find(target[0], [target[1], *parts[1:]], seen=seen)
        found = Found(module, statement, owner=None)
        for member in parts[1:]:
            if not isinstance(found.statement, ast.ClassDef):
                parent = kind_of(found.statement)
                return f"{'.'.join(parts)}: only a class has members, its parent is a {parent}"
            member_statement = top_level_bindings(found.statement.body).get(member)
            if member_statement is None:
                return f"class {found.statement.name} has no member {member}"
            found = Found(module, member_statement, owner=found.statement)
        return found

    def _reexported_from(
        self, module: str, statement: ast.ImportFrom, bound_name: str
    ) -> tuple[str, str] | None:
        """(drop module, name) that `from .x import y as bound_name` brings in, if in the drop."""
        module_name, is_package = self.parsed.import_context(module)
        package = module_name if is_package else module_name.rpartition(".")[0]
        source = resolve_relative(statement.module or "", level=statement.level, package=package)
        if source is None or not is_within(source, DROP_PACKAGE):
            return None
        original = next(a.name for a in statement.names if (a.asname or a.name) == bound_name)
        inner = source[len(DROP_PACKAGE) + 1 :] or "__init__"
        submodule = f"{inner}.{original}" if inner != "__init__" else original
        if submodule in self.parsed.modules:
            return None  # `from . import gemm` binds a module, not a symbol
        return inner, original

    def constructor_signature(self, found: Found, *, depth: int = 0) -> Signature | str:
        """A class's constructor: its __init__, its dataclass fields or a drop base's __init__."""
        node = found.statement
        assert isinstance(node, ast.ClassDef)
        init = top_level_bindings(node.body).get("__init__")
        if isinstance(init, ast.FunctionDef | ast.AsyncFunctionDef):
            return function_signature(init, bound=True)
        if "dataclass" in decorator_names(node):
            return _dataclass_signature(node)
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id == "object":
                continue
            base_found = self.find(found.module, base.id) if isinstance(base, ast.Name) else None
            is_drop_class = isinstance(base_found, Found) and isinstance(
                base_found.statement, ast.ClassDef
            )
            if is_drop_class and depth < 16:  # deeper is a cycle, or no drop a person writes
                return self.constructor_signature(base_found, depth=depth + 1)
            return (
                f"class {node.name} inherits its constructor from {ast.unparse(base)}, outside "
                "the drop: give it an __init__, or parameters=None in its entry"
            )
        return Signature(())
