"""Each package's README example runs as written, on a CPU (the examples are what a new user
pastes first)."""

import re
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[1] / "packages"


@pytest.mark.parametrize("package", ["megamoe-kernels", "megamoe-runtime", "megamoe-torch"])
def test_readme_python_examples_run(package, capsys):
    readme = PACKAGES / package / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    assert blocks, f"{readme} has no python example"
    for block in blocks:
        exec(compile(block, str(readme), "exec"), {})
    assert "torch.Size" in capsys.readouterr().out  # each example prints a shape it computed
