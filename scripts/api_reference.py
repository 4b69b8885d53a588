"""Writes docs/reference.md, the reference of megamoe_torch's public API, from the source: every
MegaMoEConfig field (its type, default and the comment above it in config.py), the MegaMoE
module's constructor, methods and properties, the Hugging Face functions (their signatures and
docstrings) and the `megamoe` command's help.

    python scripts/api_reference.py          # rewrite docs/reference.md
    python scripts/api_reference.py --check  # exit 1 when docs/reference.md is not current

tests/test_api_reference.py runs the check, so the page changes with the code.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import sys
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
# the width the command's help is rendered at (argparse reads COLUMNS)
HELP_COLUMNS = "100"


def config_fields() -> list[tuple[str, str, str, str]]:
    """(name, type, default, description) of each MegaMoEConfig field, in declaration order; the
    description is the comment block right above the field in config.py."""
    from megamoe_torch import config

    source = inspect.getsource(config)
    lines = source.splitlines()
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MegaMoEConfig"]
    fields = []
    for statement in cls.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        comment = []
        row = statement.lineno - 2  # the line above, 0-based
        while row >= 0 and lines[row].strip().startswith("#"):
            comment.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        default = "required" if statement.value is None else ast.unparse(statement.value)
        fields.append(
            (
                statement.target.id,
                ast.unparse(statement.annotation),
                default,
                " ".join(comment),
            )
        )
    return fields


def _doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else ""


def _signature(name: str, function) -> str:
    signature = str(inspect.signature(function))
    return f"{name}{signature}"


def _function_section(heading: str, name: str, function) -> list[str]:
    """A function's or method's section: its heading, signature and docstring."""
    return [
        f"### `{heading}`",
        "",
        "```python",
        _signature(name, function),
        "```",
        "",
        _doc(function) or "-",
        "",
    ]


def _members(cls) -> list[tuple[str, object]]:
    """The public methods and properties cls defines itself, in source order."""
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_") or name == "extra_repr":  # nn.Module's print hook
            continue
        if isinstance(value, property) or inspect.isfunction(value):
            members.append((name, value))
    return members


def render_config() -> list[str]:
    from megamoe_torch import MegaMoEConfig

    out = [
        "## `MegaMoEConfig`",
        "",
        _doc(MegaMoEConfig),
        "",
        "Its fields, in order (the first four are required):",
        "",
        "| field | type | default | what it sets |",
        "|---|---|---|---|",
    ]
    for name, annotation, default, description in config_fields():
        cell = description.replace("|", "\\|") or "-"
        out.append(f"| `{name}` | `{annotation}` | `{default}` | {cell} |")
    return [*out, ""]


def render_class(cls, heading: str) -> list[str]:
    out = [f"## `{heading}`", "", "```python", _signature(cls.__name__, cls), "```", ""]
    out += [_doc(cls), ""]
    for name, member in _members(cls):
        if isinstance(member, property):
            out += [f"### `{cls.__name__}.{name}` (property)", "", _doc(member.fget) or "-", ""]
        else:
            out += _function_section(f"{cls.__name__}.{name}", name, member)
    return out


def render_functions(names: list[str]) -> list[str]:
    import megamoe_torch

    out = ["## Hugging Face functions", ""]
    for name in names:
        out += _function_section(name, name, getattr(megamoe_torch, name))
    return out


def render_cli() -> list[str]:
    from megamoe_torch.cli import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        parser = build_parser()
        out = ["## The `megamoe` command", "", "```text", parser.format_help().rstrip(), "```", ""]
        (commands,) = [
            action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
        ]
        for name, command in commands.choices.items():
            help_text = command.format_help().rstrip()
            out += [f"### `megamoe {name}`", "", "```text", help_text, "```", ""]
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return out


def render() -> str:
    import megamoe_torch

    out = [
        "# API reference",
        "",
        "megamoe_torch's public API as the source states it: written by `python "
        "scripts/api_reference.py` from the code's fields, signatures and docstrings (a test "
        "keeps it current). The guides: README.md (quickstart, CUDA graphs, torch.compile, FP8), "
        "docs/huggingface.md, docs/expert-parallel.md, docs/tuning.md.",
        "",
    ]
    out += render_config()
    out += render_class(megamoe_torch.MegaMoE, "MegaMoE")
    out += render_functions(
        [
            "swap_moe_blocks",
            "unswap_moe_blocks",
            "from_hf",
            "from_hf_state_dict",
            "megamoe_state_dict_from_hf",
            "hf_state_dict_from_megamoe",
            "register_experts_implementation",
        ]
    )
    out += render_cli()
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not REFERENCE.exists() or REFERENCE.read_text() != text:
            print(f"{REFERENCE} is not current: run python scripts/api_reference.py")
            return 1
        return 0
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
