"""The resync command on synthetic drops in tmp_path: it replaces drop/ completely or not at all.

Every test works on temporary copies (drop folder, VENDOR.md, audit table), never on the real
drop, and skips the compile step unless a test fakes it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from megamoe_kernels import resync as resync_module
from megamoe_kernels.resync import check_vendor, main, recorded_digest, resync
from megamoe_kernels.shim.audit import DropSymbol

CHECKOUT_DROP_DIR = Path(__file__).resolve().parents[1] / "src" / "megamoe_kernels" / "drop"
CHECKOUT_VENDOR_PATH = Path(__file__).resolve().parents[1] / "VENDOR.md"

KERNEL = """\
import cutlass.cute as cute

from .layout import BLOCK


class Kernel:
    def __init__(self, tile_rows, *, stages=2):
        self.tile_rows = tile_rows * BLOCK

    @cute.jit
    def __call__(self, mX, mOut, stream):
        pass
"""
VERSION_1 = {
    "__init__.py": "",
    "kernel.py": KERNEL,
    "layout.py": "BLOCK = 8\n",
    "README.txt": "kernels from the kernel team\n",
}
TABLE = (
    DropSymbol("kernel", "Kernel", "class", ("tile_rows", "stages")),
    DropSymbol("kernel", "Kernel.__call__", "function", ("mX", "mOut", "stream"), "positional"),
    DropSymbol("layout", "BLOCK", "constant"),
)


def write_folder(folder: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text)
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden staging folders included) -> content."""
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


class Checkout:
    """A package folder in tmp_path holding drop/ (version 1, resynced) and VENDOR.md."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.drop_dir = root / "megamoe_kernels" / "drop"
        self.vendor_path = root / "VENDOR.md"
        self.drop_dir.parent.mkdir(parents=True)

    def resync(self, new_drop: Path, **options):
        self.lines: list[str] = []
        options.setdefault("compile_tests_dir", None)
        options.setdefault("table", TABLE)
        return resync(
            new_drop,
            drop_dir=self.drop_dir,
            vendor_path=self.vendor_path,
            echo=self.lines.append,
            **options,
        )

    def state(self) -> dict[str, bytes]:
        return snapshot(self.root)


@pytest.fixture
def checkout(tmp_path) -> Checkout:
    checkout = Checkout(tmp_path / "package")
    first = checkout.resync(write_folder(tmp_path / "v1", VERSION_1), source="kernel team v1")
    assert first.status == "replaced", first.report
    return checkout


def new_version(tmp_path: Path, *, replace: tuple[str, str, str] | None = None, **extra: str):
    """Version 1 with `replace = (file, old, new)` applied and `extra` files added."""
    files = dict(VERSION_1, **extra)
    if replace is not None:
        relative, old, new = replace
        assert old in files[relative]
        files[relative] = files[relative].replace(old, new)
    return write_folder(tmp_path / "incoming_drop", files)


def test_first_resync_copies_verbatim_and_records_every_hash(tmp_path, checkout):
    assert snapshot(checkout.drop_dir) == snapshot(tmp_path / "v1")
    recorded_sha256, recorded_files = recorded_digest(checkout.vendor_path)
    expected_files = {
        relative: hashlib.sha256(text.encode()).hexdigest() for relative, text in VERSION_1.items()
    }
    assert recorded_files == expected_files
    listing = "".join(f"{expected_files[path]}  {path}\n" for path in sorted(expected_files))
    assert recorded_sha256 == hashlib.sha256(listing.encode()).hexdigest()
    vendor = checkout.vendor_path.read_text()
    assert "| source | kernel team v1 |" in vendor
    assert "| previous drop sha256 | none |" in vendor
    assert check_vendor(drop_dir=checkout.drop_dir, vendor_path=checkout.vendor_path) == []


def test_an_identical_copy_is_a_no_op_with_the_hash_unchanged(tmp_path, checkout):
    drop_before = snapshot(checkout.drop_dir)
    inode_before = checkout.drop_dir.stat().st_ino
    result = checkout.resync(new_version(tmp_path), source="kernel team v1, again")
    assert result.status == "recorded" and result.ok
    assert result.new_sha256 == result.previous_sha256
    assert snapshot(checkout.drop_dir) == drop_before
    assert checkout.drop_dir.stat().st_ino == inode_before  # not even swapped
    vendor = checkout.vendor_path.read_text()
    assert f"| previous drop sha256 | `{result.new_sha256}` |" in vendor
    assert recorded_digest(checkout.vendor_path)[0] == result.new_sha256


def assert_refused_and_untouched(checkout: Checkout, result, state_before, *, reason: str):
    assert result.status == "refused" and not result.ok
    assert reason in result.report, result.report
    assert "nothing changed" in result.report
    assert checkout.state() == state_before  # drop/, VENDOR.md, and no staging leftovers


def test_a_drop_missing_a_symbol_the_shim_uses_is_refused(tmp_path, checkout):
    state_before = checkout.state()
    incoming = new_version(tmp_path, replace=("layout.py", "BLOCK = 8", "BLOCK_COLUMNS = 8"))
    incoming = write_folder(incoming, {"kernel.py": KERNEL.replace("BLOCK", "BLOCK_COLUMNS")})
    result = checkout.resync(incoming)
    assert_refused_and_untouched(checkout, result, state_before, reason="BLOCK is not defined")
    assert "layout.BLOCK (constant)" in result.report


def test_a_changed_signature_is_refused_until_the_shim_table_follows(tmp_path, checkout):
    state_before = checkout.state()
    incoming = new_version(
        tmp_path, replace=("kernel.py", "mX, mOut, stream", "mX, mOut, mScale, stream")
    )
    result = checkout.resync(incoming)
    assert_refused_and_untouched(checkout, result, state_before, reason="position 2 is 'mScale'")

    # The shim is adapted (here: its table) and the same drop goes in.
    adapted = (
        *TABLE[:1],
        DropSymbol(
            "kernel",
            "Kernel.__call__",
            "function",
            ("mX", "mOut", "mScale", "stream"),
            "positional",
        ),
        *TABLE[2:],
    )
    result = checkout.resync(incoming, table=adapted)
    assert result.status == "replaced", result.report
    assert (checkout.drop_dir / "kernel.py").read_text() == (incoming / "kernel.py").read_text()


@pytest.mark.parametrize(
    ("replace", "reason"),
    [
        (
            ("kernel.py", "import cutlass.cute", "import torch\nimport cutlass.cute"),
            "never imports torch",
        ),
        (
            ("layout.py", "BLOCK = 8", "from megamoe_kernels import reference\nBLOCK = 8"),
            "never imports megamoe_kernels",
        ),
        (
            ("layout.py", "BLOCK = 8", "from .. import reference\nBLOCK = 8"),
            "'megamoe_kernels.reference'",
        ),
        (("layout.py", "BLOCK = 8", "BLOCK = (8"), "drop/layout.py: line 1"),
    ],
)
def test_a_forbidden_import_or_unparsable_file_is_refused(tmp_path, checkout, replace, reason):
    state_before = checkout.state()
    result = checkout.resync(new_version(tmp_path, replace=replace))
    assert_refused_and_untouched(checkout, result, state_before, reason=reason)


def test_an_extra_unused_kernel_is_accepted_and_reported(tmp_path, checkout):
    previous_sha256 = recorded_digest(checkout.vendor_path)[0]
    extra_kernel = "import cutlass.cute as cute\n\n\nclass FusedDown:\n    pass\n"
    incoming = new_version(tmp_path, **{"extra/fused_down.py": extra_kernel})
    result = checkout.resync(incoming, source="kernel team v2")
    assert result.status == "replaced", result.report
    assert "drop/extra/fused_down.py: FusedDown (class)" in result.report
    assert snapshot(checkout.drop_dir) == snapshot(incoming)
    assert result.previous_sha256 == previous_sha256 != result.new_sha256
    vendor = checkout.vendor_path.read_text()
    assert f"| previous drop sha256 | `{previous_sha256}` |" in vendor
    assert "| `extra/fused_down.py` |" in vendor
    assert sorted(path.name for path in checkout.drop_dir.parent.iterdir()) == ["drop"]


def test_files_removed_from_the_new_drop_are_gone_after_the_resync(tmp_path, checkout):
    incoming = new_version(tmp_path)
    (incoming / "README.txt").unlink()
    assert checkout.resync(incoming).status == "replaced"
    assert not (checkout.drop_dir / "README.txt").exists()


def test_dry_run_changes_nothing(tmp_path, checkout):
    state_before = checkout.state()
    incoming = new_version(tmp_path, **{"more.py": "import math\n"})
    result = checkout.resync(incoming, dry_run=True)
    assert result.status == "dry-run" and result.ok
    assert result.new_sha256 != result.previous_sha256
    assert "dry run: nothing written" in result.report
    assert checkout.state() == state_before


def fail_on_call(real, *, failing_call_number: int, matches=lambda *arguments: True):
    """`real`, failing with a full disk on its `failing_call_number`-th call that `matches`."""
    calls = []

    def failing(*arguments, **keywords):
        if matches(*arguments):
            calls.append(arguments)
            if len(calls) == failing_call_number:
                raise OSError(28, "No space left on device (injected)")
        return real(*arguments, **keywords)

    return failing


@pytest.mark.parametrize(
    ("target", "function_name", "matches"),
    [
        (shutil, "copy2", lambda *_: True),  # midway through copying the new files
        (os, "rename", lambda source, _: Path(source).name == ".drop.incoming"),  # the swap in
        (os, "replace", lambda source, _: Path(source).name == ".VENDOR.md.incoming"),
    ],
    ids=["copy", "swap", "vendor"],
)
def test_a_failure_midway_leaves_the_old_drop_intact(
    tmp_path, checkout, monkeypatch, target, function_name, matches
):
    state_before = checkout.state()
    incoming = new_version(tmp_path, **{"more.py": "import math\n", "most.py": "import os\n"})
    real = getattr(target, function_name)
    call_number = 2 if function_name == "copy2" else 1  # copy2: after one file is copied
    failing = fail_on_call(real, failing_call_number=call_number, matches=matches)
    monkeypatch.setattr(target, function_name, failing)
    result = checkout.resync(incoming)
    monkeypatch.undo()
    assert_refused_and_untouched(checkout, result, state_before, reason="(injected)")


def test_failing_compile_tests_put_the_previous_drop_back(tmp_path, checkout, monkeypatch):
    state_before = checkout.state()
    ran = []

    def failing_compile_tests(tests_dir):
        ran.append(snapshot(checkout.drop_dir))  # they run against the new drop, in place
        return False, "E   TypeError: Kernel.__init__() got an unexpected keyword argument"

    monkeypatch.setattr(resync_module, "run_compile_tests", failing_compile_tests)
    incoming = new_version(tmp_path, **{"more.py": "import math\n"})
    result = checkout.resync(incoming, compile_tests_dir=tmp_path)
    assert ran == [snapshot(incoming)]
    assert_refused_and_untouched(
        checkout, result, state_before, reason="compile-only kernel tests failed"
    )
    assert "unexpected keyword argument" in result.report


def test_an_interrupted_compile_step_puts_the_previous_drop_back(tmp_path, checkout, monkeypatch):
    state_before = checkout.state()

    def interrupted(tests_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(resync_module, "run_compile_tests", interrupted)
    incoming = new_version(tmp_path, **{"more.py": "import math\n"})
    with pytest.raises(KeyboardInterrupt):
        checkout.resync(incoming, compile_tests_dir=tmp_path)
    assert checkout.state() == state_before


def test_passing_compile_tests_keep_the_new_drop(tmp_path, checkout, monkeypatch):
    monkeypatch.setattr(resync_module, "run_compile_tests", lambda tests_dir: (True, "3 passed"))
    incoming = new_version(tmp_path, **{"more.py": "import math\n"})
    result = checkout.resync(incoming, compile_tests_dir=tmp_path)
    assert result.status == "replaced"
    assert "compile tests" in result.report and "3 passed" in result.report
    assert snapshot(checkout.drop_dir) == snapshot(incoming)


def test_a_symlink_in_the_new_drop_is_refused(tmp_path, checkout):
    state_before = checkout.state()
    incoming = new_version(tmp_path)
    (incoming / "linked.py").symlink_to(incoming / "layout.py")
    result = checkout.resync(incoming)
    assert_refused_and_untouched(
        checkout, result, state_before, reason="linked.py is a symbolic link"
    )


@pytest.mark.parametrize("where", ["missing", "inside the drop", "a file"])
def test_a_path_that_is_not_a_drop_folder_is_refused(tmp_path, checkout, where):
    (checkout.drop_dir / "sub").mkdir()
    path = {
        "missing": tmp_path / "nowhere",
        "inside the drop": checkout.drop_dir / "sub",
        "a file": checkout.drop_dir / "layout.py",
    }[where]
    state_before = checkout.state()
    result = checkout.resync(path)
    assert_refused_and_untouched(checkout, result, state_before, reason=f"PATH='{path}'")


def test_a_leftover_from_an_interrupted_resync_is_refused_with_what_to_do(tmp_path, checkout):
    leftover = checkout.drop_dir.with_name(".drop.outgoing")
    shutil.copytree(checkout.drop_dir, leftover)
    state_before = checkout.state()
    result = checkout.resync(new_version(tmp_path, **{"more.py": "import math\n"}))
    assert_refused_and_untouched(checkout, result, state_before, reason="interrupted resync")


def test_check_names_the_files_edited_by_hand(checkout):
    (checkout.drop_dir / "layout.py").write_text("BLOCK = 16\n")
    (checkout.drop_dir / "README.txt").unlink()
    problems = check_vendor(drop_dir=checkout.drop_dir, vendor_path=checkout.vendor_path)
    assert "drop/layout.py: changed since VENDOR.md" in problems
    assert "drop/README.txt: removed since VENDOR.md" in problems
    assert "python -m megamoe_kernels.resync" in problems[-1]


def test_the_command_line_exits_nonzero_on_refusal_and_zero_on_success(tmp_path, capsys):
    drop_dir = tmp_path / "megamoe_kernels" / "drop"
    vendor_path = tmp_path / "VENDOR.md"
    targets = [
        "--drop-dir",
        str(drop_dir),
        "--vendor-file",
        str(vendor_path),
        "--skip-compile-tests",
    ]
    assert main([str(tmp_path / "nowhere"), *targets]) == 1
    assert "REFUSED" in capsys.readouterr().out
    # the real drop passes the real audit table, so it installs into the temporary folder
    assert main([str(CHECKOUT_DROP_DIR), "--dry-run", *targets]) == 0
    assert not drop_dir.exists() and not vendor_path.exists()
    assert main([str(CHECKOUT_DROP_DIR), "--source", "test", *targets]) == 0
    assert snapshot(drop_dir) == {
        path: content
        for path, content in snapshot(CHECKOUT_DROP_DIR).items()
        if "__pycache__" not in path
    }
    assert main(["--check", "--drop-dir", str(drop_dir), "--vendor-file", str(vendor_path)]) == 0


@pytest.mark.parametrize(
    ("test_source", "passed", "expected_output"),
    [
        ("@pytest.mark.compile\ndef test_compiles():\n    pass\n", True, "1 passed"),
        ("@pytest.mark.compile\ndef test_compiles():\n    assert 1 == 2\n", False, "assert 1 == 2"),
        ("def test_not_a_compile_test():\n    pass\n", True, "no compile tests were collected"),
    ],
)
def test_compile_tests_run_only_tests_marked_compile(
    tmp_path, test_source, passed, expected_output
):
    tests_dir = write_folder(
        tmp_path / "tests", {"test_kernel.py": "import pytest\n\n\n" + test_source}
    )
    outcome, output = resync_module.run_compile_tests(tests_dir)
    assert outcome is passed
    assert expected_output in output


def test_the_drop_hash_is_the_sha256sum_listing_sorted_by_path_text(tmp_path):
    files = {"a.py": "A = 1\n", "a/b.py": "B = 2\n", "a-b.py": "C = 3\n", ".keep": ""}
    folder = write_folder(tmp_path / "drop", files)
    write_folder(folder, {"__pycache__/a.cpython-311.pyc": "cache", ".git/HEAD": "ref"})
    digest = resync_module.digest_drop(folder)
    listing = "".join(
        f"{hashlib.sha256(files[path].encode()).hexdigest()}  {path}\n" for path in sorted(files)
    )
    assert [file.path for file in digest.files] == sorted(files)  # "a-b.py" < "a.py" < "a/b.py"
    assert digest.sha256 == hashlib.sha256(listing.encode()).hexdigest()


def test_this_checkouts_drop_matches_its_vendor_record():
    # drop/ is kept verbatim: a change comes in through resync, which rewrites VENDOR.md. The
    # checkout's paths, not the installed package's: nox installs the package as a wheel.
    problems = check_vendor(drop_dir=CHECKOUT_DROP_DIR, vendor_path=CHECKOUT_VENDOR_PATH)
    assert problems == [], "\n".join(problems)
