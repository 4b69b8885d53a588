"""Test sessions. Each package session builds a fresh venv holding only that package and what it
declares, so a missing declaration fails here, not in a user's hands.

    nox                 # the sessions that run on a CPU (CI runs these)
    nox -s kernels      # one package alone
    nox -s gpu          # tests marked gpu (skip without an sm_90 GPU)
    nox -s multirank    # 2 ranks: gloo on a CPU, GPUs where present (MEGAMOE_RANKS=4 for more)
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "kernels", "runtime", "torch", "tests", "multirank"]
nox.options.reuse_existing_virtualenvs = False

KERNELS = "packages/megamoe-kernels"
RUNTIME = "packages/megamoe-runtime"
TORCH = "packages/megamoe-torch"
PYTHON = "3.11"
# CuTe DSL compiles for Hopper without a GPU only when told the architecture
COMPILE_ENV = {"CUTE_DSL_ARCH": "sm_90a"}
# pytest exits 5 when every test was deselected: a package without tests of a marker is fine
PYTEST_OK = [0, 5]


def pytest(session: nox.Session, *args: str) -> None:
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        *args,
        *session.posargs,
        env=COMPILE_ENV,
        success_codes=PYTEST_OK,
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")  # pinned: formatting rules change between releases
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def kernels(session: nox.Session) -> None:
    """megamoe-kernels alone: oracles, boundary check, resync, compile-only kernel tests."""
    session.install(f"{KERNELS}[test]")
    pytest(session, "-m", "not gpu and not multirank", f"{KERNELS}/tests")


@nox.session(python=PYTHON)
def runtime(session: nox.Session) -> None:
    session.install(KERNELS, f"{RUNTIME}[test]")
    pytest(session, "-m", "not gpu and not multirank", f"{RUNTIME}/tests")


@nox.session(python=PYTHON)
def torch(session: nox.Session) -> None:
    """megamoe-torch with its Hugging Face extra: the layer, interop and CLI."""
    session.install(KERNELS, RUNTIME, f"{TORCH}[test,hf]")
    pytest(session, "-m", "not gpu and not multirank", f"{TORCH}/tests")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Cross-package tests: the layer end to end, the CLI."""
    session.install(KERNELS, RUNTIME, f"{TORCH}[test,plot]")
    pytest(session, "-m", "not gpu and not multirank", "tests")


@nox.session(python=PYTHON)
def multirank(session: nox.Session) -> None:
    """Multi-rank tests under torchrun (gloo on a CPU, NCCL/NVSHMEM where GPUs exist), then the
    tests that ask for 4 and 8 ranks, on ranks the fixture spawns itself (CPU, gloo)."""
    session.install(KERNELS, RUNTIME, f"{TORCH}[test]")
    ranks = os.environ.get("MEGAMOE_RANKS", "2")
    session.run(
        "torchrun",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "pytest",
        "-q",
        "-m",
        "multirank",
        "-p",
        "no:cacheprovider",
        "tests",
        *session.posargs,
        env=COMPILE_ENV,
        success_codes=PYTEST_OK,
    )
    pytest(session, "-m", "multirank", "-k", "more_ranks", "tests")


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """Tests marked gpu; they skip without an sm_90 GPU. They run in MEGAMOE_GPU_WORKERS (6)
    worker processes sharing the GPU, which compile their kernels in parallel; the real-size
    layers of tests/test_gpu_layer.py run alone after them (DeepSeek-V3's takes half an 80 GB
    GPU)."""
    session.install(KERNELS, f"{RUNTIME}[test]", f"{TORCH}[test,hf]", "pytest-xdist>=3")
    workers = os.environ.get("MEGAMOE_GPU_WORKERS", "6")
    suites = (f"{KERNELS}/tests", f"{RUNTIME}/tests", f"{TORCH}/tests", "tests")
    pytest(session, "-m", "gpu", "-n", workers, *suites, "--deselect", "tests/test_gpu_layer.py")
    pytest(session, "-m", "gpu", "tests/test_gpu_layer.py")


@nox.session(python=PYTHON, name="compile")
def compile_kernels(session: nox.Session) -> None:
    """Compile every kernel variant for sm_90a (no GPU needed)."""
    session.install(f"{KERNELS}[test]")
    pytest(session, "-m", "compile", f"{KERNELS}/tests")
