"""docs/reference.md is what scripts/api_reference.py writes from the code as it is: a field,
signature, docstring or command option changed without the page fails here."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "api_reference.py"


def _api_reference():
    spec = importlib.util.spec_from_file_location("api_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_page_is_current():
    api_reference = _api_reference()
    assert api_reference.REFERENCE.read_text() == api_reference.render(), (
        "docs/reference.md is not current: run python scripts/api_reference.py"
    )


def test_every_config_field_is_described():
    undescribed = [name for name, _, _, text in _api_reference().config_fields() if not text]
    assert undescribed == [], f"MegaMoEConfig fields without a comment above them: {undescribed}"
