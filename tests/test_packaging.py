"""The three packages agree on one version and one license. Each package builds from its own
folder, so each pyproject declares the version; the workspace root is never built and declares
none (`dynamic`)."""

import tomllib
from pathlib import Path

import megamoe_kernels
import megamoe_runtime
import megamoe_torch
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "megamoe-kernels": megamoe_kernels,
    "megamoe-runtime": megamoe_runtime,
    "megamoe-torch": megamoe_torch,
}


def pyproject_version(folder: Path) -> str:
    with (folder / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)["project"]["version"]


def test_every_package_declares_the_same_version():
    versions = {name: pyproject_version(ROOT / "packages" / name) for name in PACKAGES}
    assert len(set(versions.values())) == 1, versions


@pytest.mark.parametrize("distribution", sorted(PACKAGES))
def test_version_attribute_is_the_installed_version(distribution):
    assert PACKAGES[distribution].__version__ == pyproject_version(ROOT / "packages" / distribution)


@pytest.mark.parametrize("distribution", sorted(PACKAGES))
def test_package_license_is_the_root_license(distribution):
    # license files cannot point outside a package's folder, so each package holds a copy
    package_license = ROOT / "packages" / distribution / "LICENSE"
    assert package_license.read_bytes() == (ROOT / "LICENSE").read_bytes()
