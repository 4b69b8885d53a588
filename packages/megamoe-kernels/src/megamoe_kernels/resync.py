"""Resync the kernel drop: `python -m megamoe_kernels.resync PATH [--source TEXT] [--dry-run]`.

Replaces `megamoe_kernels/drop/` with the folder PATH, verbatim, in one step that either succeeds
completely or changes nothing:

1. validate the new drop: every .py parses; it imports only cutlass, cuda, nvshmem, the standard
   library and its own modules (never megamoe_*, never torch);
2. audit it against the shim's table (`shim/audit.py`): every symbol the shim uses is there with
   compatible parameters; kernels the shim does not use are reported and accepted;
3. copy it into a temporary sibling of drop/, check the copy's hashes, swap the two folders by
   rename and write VENDOR.md (source, UTC time, sha256 per file and of the whole drop, the
   previous drop's sha256);
4. run the compile-only kernel tests (`pytest -m compile`); if they fail, put the previous drop
   and VENDOR.md back.

Any failure exits non-zero with a report saying what to fix; drop/ and VENDOR.md are then as they
were. `--check` compares drop/ with VENDOR.md (a drop edited by hand fails it). docs/kernels.md
walks through the workflow.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megamoe_kernels.drop_scan import (
    DROP_DIR,
    ParsedDrop,
    drop_import_problems,
    list_drop_files,
    parse_drop,
)

# Importing shim/ imports the current drop: if a hand edit broke drop/, say how to recover.
try:
    from megamoe_kernels.shim.audit import AUDIT_TABLE, DropSymbol, audit_drop
except (ImportError, SyntaxError) as error:
    raise ImportError(
        f"megamoe_kernels.shim does not import ({error}); if drop/ was edited by hand, restore "
        "it from git (it is kept verbatim and matches VENDOR.md), then rerun the resync"
    ) from error

PACKAGE_DIR = DROP_DIR.parent.parent.parent  # packages/megamoe-kernels in a checkout
VENDOR_PATH = PACKAGE_DIR / "VENDOR.md"
KERNEL_TESTS_DIR = PACKAGE_DIR / "tests"


def validate_drop(new_drop: Path, parsed: ParsedDrop) -> list[str]:
    """What makes a folder unfit to be the drop: links, no Python, unparsable files, imports."""
    problems = []
    for folder, subfolders, files in os.walk(new_drop):
        for name in [*subfolders, *files]:
            path = Path(folder) / name
            if path.is_symlink():
                problems.append(
                    f"{path.relative_to(new_drop)} is a symbolic link: a drop is plain files, "
                    "copy what it points to into the folder"
                )
    if not parsed.modules and not parsed.parse_errors:
        problems.append(f"{new_drop} holds no .py file: PATH is the folder of the kernel sources")
    problems += parsed.parse_errors
    problems += drop_import_problems(parsed)
    return problems


# ---------------------------------------------------------------------------------------------
# Content hashes and VENDOR.md


@dataclass(frozen=True)
class DropFile:
    path: str  # relative to the drop, with forward slashes
    sha256: str
    size: int


@dataclass(frozen=True)
class DropDigest:
    """The sha256 of every file of a drop, and of the whole drop."""

    files: tuple[DropFile, ...]

    @property
    def sha256(self) -> str:
        # sha256sum's output format: a person can recompute it with standard tools
        listing = "".join(f"{file.sha256}  {file.path}\n" for file in self.files)
        return hashlib.sha256(listing.encode()).hexdigest()


def digest_drop(drop_dir: Path) -> DropDigest | None:
    """The content hashes of `drop_dir`, or None when there is no such folder."""
    if not Path(drop_dir).is_dir():
        return None
    files = []
    for relative in list_drop_files(drop_dir):
        content = (Path(drop_dir) / relative).read_bytes()
        files.append(
            DropFile(relative.as_posix(), hashlib.sha256(content).hexdigest(), len(content))
        )
    return DropDigest(tuple(files))


def format_vendor(
    digest: DropDigest, *, source: str, synced_at: datetime.datetime, previous_sha256: str | None
) -> str:
    """VENDOR.md: where the drop came from, when, and the hashes that pin it."""
    source_cell = " ".join(source.split()).replace("|", "\\|")
    previous = f"`{previous_sha256}`" if previous_sha256 else "none"
    lines = [
        "# VENDOR: the kernel drop",
        "",
        "`src/megamoe_kernels/drop/` holds this drop verbatim. `python -m megamoe_kernels.resync`",
        "writes this file; edit neither by hand (docs/kernels.md, the resync workflow).",
        "",
        "| field | value |",
        "| --- | --- |",
        f"| source | {source_cell} |",
        f"| synced (UTC) | {synced_at.strftime('%Y-%m-%dT%H:%M:%SZ')} |",
        f"| drop sha256 | `{digest.sha256}` |",
        f"| previous drop sha256 | {previous} |",
        f"| files | {len(digest.files)} |",
        "",
        "The drop's sha256 is the sha256 of the `sha256sum`-style listing of its files: one line",
        "`<file sha256>  <path>` per file, sorted by path (byte order), each ending in a newline.",
        "",
        "| file | sha256 | bytes |",
        "| --- | --- | --- |",
        *(f"| `{file.path}` | `{file.sha256}` | {file.size} |" for file in digest.files),
    ]
    return "\n".join(lines) + "\n"


def recorded_digest(vendor_path: Path) -> tuple[str | None, dict[str, str]]:
    """(whole-drop sha256, {path: sha256}) as VENDOR.md records them."""
    whole = None
    files = {}
    for line in Path(vendor_path).read_text().splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] == "drop sha256":
            whole = cells[1]
        elif len(cells) == 3 and len(cells[1]) == 64 and line.startswith("| `"):
            files[cells[0]] = cells[1]
    return whole, files


def check_vendor(*, drop_dir: Path = DROP_DIR, vendor_path: Path = VENDOR_PATH) -> list[str]:
    """Differences between drop/ and what VENDOR.md records; empty when they agree."""
    if not Path(vendor_path).is_file():
        return [f"{vendor_path} is missing: record the drop with a resync (docs/kernels.md)"]
    digest = digest_drop(drop_dir)
    if digest is None:
        return [f"{drop_dir} is missing"]
    recorded_sha256, recorded_files = recorded_digest(vendor_path)
    if recorded_sha256 == digest.sha256:
        return []
    actual_files = {file.path: file.sha256 for file in digest.files}
    problems = [
        f"drop/{path}: {'changed' if path in recorded_files else 'added'} since VENDOR.md"
        for path, sha256 in actual_files.items()
        if recorded_files.get(path) != sha256
    ]
    problems += [
        f"drop/{path}: removed since VENDOR.md"
        for path in recorded_files.keys() - actual_files.keys()
    ]
    problems.append(
        f"drop/ sha256 is {digest.sha256}, VENDOR.md records {recorded_sha256}: drop/ is kept "
        "verbatim; bring changes in as a new drop with `python -m megamoe_kernels.resync PATH "
        "--source TEXT` (docs/kernels.md)"
    )
    return problems


# ---------------------------------------------------------------------------------------------
# Installing a drop


def staging_paths(drop_dir: Path) -> tuple[Path, Path]:
    """(incoming, outgoing): siblings of drop/ for the new copy and the replaced drop."""
    return (
        drop_dir.with_name(f".{drop_dir.name}.incoming"),
        drop_dir.with_name(f".{drop_dir.name}.outgoing"),
    )


def _copy_drop(new_drop: Path, destination: Path, *, expected: DropDigest) -> None:
    for relative in list_drop_files(new_drop):
        (destination / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(new_drop / relative, destination / relative)
    if digest_drop(destination) != expected:
        raise OSError(
            f"the copy in {destination} differs from {new_drop}: did it change meanwhile?"
        )


@dataclass(frozen=True)
class InstalledDrop:
    """A drop just put in place, with what it replaced kept until `commit` or `rollback`."""

    drop_dir: Path
    vendor_path: Path
    previous_vendor: bytes | None
    replaced_folder: bool
    had_previous_drop: bool

    def rollback(self) -> None:
        """Puts the previous drop/ and VENDOR.md back."""
        if self.replaced_folder:
            _restore_previous_drop(self.drop_dir, had_previous_drop=self.had_previous_drop)
        if self.previous_vendor is None:
            self.vendor_path.unlink(missing_ok=True)
        else:
            self.vendor_path.write_bytes(self.previous_vendor)

    def commit(self) -> None:
        """Deletes the replaced drop."""
        shutil.rmtree(staging_paths(self.drop_dir)[1], ignore_errors=True)


def _restore_previous_drop(drop_dir: Path, *, had_previous_drop: bool) -> None:
    incoming, outgoing = staging_paths(drop_dir)
    if drop_dir.exists():
        os.rename(drop_dir, incoming)
    if had_previous_drop:
        os.rename(outgoing, drop_dir)
    shutil.rmtree(incoming, ignore_errors=True)


def install_drop(
    new_drop: Path, digest: DropDigest, *, drop_dir: Path, vendor_path: Path, vendor_text: str
) -> InstalledDrop:
    """Copies `new_drop` beside drop/, swaps the two by rename and writes VENDOR.md.

    On any failure (copy, swap, VENDOR.md) drop/ and VENDOR.md are put back and the error raised.
    """
    incoming, outgoing = staging_paths(drop_dir)
    vendor_incoming = vendor_path.with_name(f".{vendor_path.name}.incoming")
    previous = digest_drop(drop_dir)
    installed = InstalledDrop(
        drop_dir,
        vendor_path,
        previous_vendor=vendor_path.read_bytes() if vendor_path.is_file() else None,
        replaced_folder=previous is None or previous.sha256 != digest.sha256,
        had_previous_drop=previous is not None,
    )
    swapped = False
    try:
        if installed.replaced_folder:
            _copy_drop(new_drop, incoming, expected=digest)
        vendor_incoming.write_text(vendor_text)
        if installed.replaced_folder:
            if installed.had_previous_drop:
                os.rename(drop_dir, outgoing)
            swapped = True
            os.rename(incoming, drop_dir)
        os.replace(vendor_incoming, vendor_path)
    except BaseException:
        if swapped:
            _restore_previous_drop(drop_dir, had_previous_drop=installed.had_previous_drop)
        shutil.rmtree(incoming, ignore_errors=True)
        vendor_incoming.unlink(missing_ok=True)
        raise
    return installed


def run_compile_tests(tests_dir: Path) -> tuple[bool, str]:
    """Runs `pytest -m compile` on the kernel tests (CuTe DSL compiles for sm_90a, no GPU)."""
    environment = {**os.environ, "CUTE_DSL_ARCH": os.environ.get("CUTE_DSL_ARCH", "sm_90a")}
    command = [sys.executable, "-m", "pytest", "-q", "-m", "compile", "-p", "no:cacheprovider"]
    completed = subprocess.run(
        [*command, str(tests_dir)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=tests_dir.parent,
        check=False,
    )
    output_lines = (completed.stdout + completed.stderr).strip().splitlines() or ["(no output)"]
    no_tests_collected = 5  # pytest's exit code when every test was deselected
    if completed.returncode == no_tests_collected:
        return True, "no compile tests were collected"
    if completed.returncode == 0:
        return True, output_lines[-1]  # pytest's summary line
    return False, "\n".join(output_lines[-40:])


# ---------------------------------------------------------------------------------------------
# The command


@dataclass(frozen=True)
class ResyncResult:
    """How a resync ended: "refused" (nothing changed), "dry-run", "recorded" (same content,
    VENDOR.md rewritten) or "replaced"; `report` is what it printed."""

    status: str
    report: str
    previous_sha256: str | None
    new_sha256: str | None

    @property
    def ok(self) -> bool:
        return self.status != "refused"


def _run_and_report_compile_tests(
    compile_tests_dir: Path | None, say: Callable[[str], None]
) -> bool:
    if compile_tests_dir is None:
        say("compile tests: skipped; run `pytest -m compile` on the kernel tests before committing")
        return True
    if not compile_tests_dir.is_dir():
        say(f"compile tests: skipped, {compile_tests_dir} is not here (not a checkout?)")
        return True
    passed, output = run_compile_tests(compile_tests_dir)
    say(f"compile tests ({compile_tests_dir}): {'passed' if passed else 'FAILED'}")
    say("\n".join(f"  | {line}" for line in output.splitlines()))
    return passed


def _placement_problems(new_drop: Path, drop_dir: Path) -> list[str]:
    if not new_drop.is_dir():
        return [f"PATH={str(new_drop)!r} is not a folder: pass the folder holding the new drop"]
    source, target = new_drop.resolve(), drop_dir.resolve()
    if source != target and (source in target.parents or target in source.parents):
        return [f"PATH={str(new_drop)!r} and the drop {drop_dir} contain one another"]
    _, outgoing = staging_paths(drop_dir)
    if outgoing.exists():
        return [
            f"{outgoing} is left from an interrupted resync and holds the drop before it: if "
            f"{drop_dir} is right (`--check`), delete it; otherwise move it back to {drop_dir}"
        ]
    return []


def resync(
    new_drop: Path,
    *,
    drop_dir: Path = DROP_DIR,
    vendor_path: Path = VENDOR_PATH,
    source: str | None = None,
    dry_run: bool = False,
    compile_tests_dir: Path | None = KERNEL_TESTS_DIR,
    table: tuple[DropSymbol, ...] = AUDIT_TABLE,
    echo: Callable[[str], None] = print,
) -> ResyncResult:
    """Replaces `drop_dir` with `new_drop` if it validates and passes the audit; see the module
    docstring. `compile_tests_dir=None` skips the compile tests."""
    new_drop, drop_dir, vendor_path = Path(new_drop), Path(drop_dir), Path(vendor_path)
    lines: list[str] = []

    def say(text: str) -> None:
        lines.append(text)
        echo(text)

    def finish(status: str, new_sha256: str | None = None) -> ResyncResult:
        return ResyncResult(status, "\n".join(lines), previous_sha256, new_sha256)

    def refuse(reason: str) -> ResyncResult:
        say(f"REFUSED: {reason}")
        say(f"nothing changed: {drop_dir} and {vendor_path} are as they were")
        return finish("refused")

    previous_digest = digest_drop(drop_dir)
    previous_sha256 = previous_digest.sha256 if previous_digest else None
    placement = _placement_problems(new_drop, drop_dir)
    if placement:
        return refuse(placement[0])
    parsed = parse_drop(new_drop)
    problems = validate_drop(new_drop, parsed)
    say(f"validation of {new_drop}:")
    say("\n".join(f"  - {problem}" for problem in problems) or "  ok: parses, allowed imports only")
    audit = audit_drop(new_drop, table=table, parsed=parsed)
    say(audit.format())
    if problems or not audit.passed:
        count = len(problems) + len(audit.problems)
        return refuse(f"{count} problem(s) above; fix them in the drop or in the shim and rerun")

    new_digest = digest_drop(new_drop)
    assert new_digest is not None
    same = previous_sha256 == new_digest.sha256
    change = "unchanged" if same else f"{previous_sha256 or 'none'} -> {new_digest.sha256}"
    say(f"drop sha256: {new_digest.sha256} ({change}), {len(new_digest.files)} files")
    if dry_run:
        say("dry run: nothing written")
        return finish("dry-run", new_digest.sha256)

    vendor_text = format_vendor(
        new_digest,
        source=source or f"local folder {new_drop.resolve()} (no --source given)",
        synced_at=datetime.datetime.now(datetime.UTC),
        previous_sha256=previous_sha256,
    )
    try:
        installed = install_drop(
            new_drop,
            new_digest,
            drop_dir=drop_dir,
            vendor_path=vendor_path,
            vendor_text=vendor_text,
        )
    except OSError as error:
        return refuse(f"installing the drop failed ({error}); the previous drop was kept")
    say(f"{'recorded' if same else 'installed'} {drop_dir}; wrote {vendor_path}")

    try:
        passed = _run_and_report_compile_tests(compile_tests_dir, say)
    except BaseException:  # Ctrl-C in a long compile: leave no half-finished resync behind
        installed.rollback()
        raise
    if not passed:
        installed.rollback()
        return refuse(
            "the compile-only kernel tests failed against the new drop (output above): adapt "
            "shim/ to it, or install it with --skip-compile-tests to debug in place"
        )
    installed.commit()
    return finish("recorded" if same else "replaced", new_digest.sha256)


def _is_checkout() -> bool:
    return (PACKAGE_DIR / "pyproject.toml").is_file() and (PACKAGE_DIR / "src").is_dir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megamoe_kernels.resync",
        description="Replace megamoe_kernels/drop/ with a new kernel drop, verbatim and atomically, "
        "after validating and auditing it; record it in VENDOR.md; run the compile-only tests.",
    )
    parser.add_argument("path", nargs="?", type=Path, help="the folder holding the new drop")
    parser.add_argument("--source", help="where the drop comes from (repository, commit, date)")
    parser.add_argument("--dry-run", action="store_true", help="validate and audit, write nothing")
    parser.add_argument("--skip-compile-tests", action="store_true", help="skip pytest -m compile")
    parser.add_argument("--check", action="store_true", help="compare drop/ with VENDOR.md")
    parser.add_argument("--drop-dir", type=Path, default=None, help="default: this checkout's")
    parser.add_argument("--vendor-file", type=Path, default=None, help="default: this checkout's")
    arguments = parser.parse_args(argv)

    if arguments.drop_dir is None and not _is_checkout():
        parser.error(
            f"{DROP_DIR} is not in a checkout of megamoe: resync edits the source tree; run it "
            "from an editable install (uv sync), or pass --drop-dir and --vendor-file"
        )
    drop_dir = arguments.drop_dir or DROP_DIR
    vendor_path = arguments.vendor_file or VENDOR_PATH
    if arguments.check:
        problems = check_vendor(drop_dir=drop_dir, vendor_path=vendor_path)
        print("\n".join(problems) or f"{drop_dir} matches {vendor_path}")
        return 1 if problems else 0
    if arguments.path is None:
        parser.error("PATH is required (the folder holding the new drop), unless --check")
    result = resync(
        arguments.path,
        drop_dir=drop_dir,
        vendor_path=vendor_path,
        source=arguments.source,
        dry_run=arguments.dry_run,
        # the compile tests import the installed package: they exercise only this checkout's drop
        compile_tests_dir=None
        if arguments.skip_compile_tests or drop_dir.resolve() != DROP_DIR.resolve()
        else KERNEL_TESTS_DIR,
    )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
