"""Every MoE family of the installed transformers, swapped on a tiny random model (hf_family_walk.py).

A family either swaps exactly (fp32 logits within 1e-5 rel-L2, greedy generate() equal, the
checkpoint saved and read back as the original's) or every MoE block it has is left in place and
reported with the reason. The families that swap exactly with transformers 5.25 must keep doing
so: a transformers release that changes one of them fails here, and one that adds a family shows
up as a new test. Older releases that build one of them in a layout megamoe does not read
(`OLDER_LAYOUTS`) must have it reported with that layout as the reason.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_family_walk import NOT_WALKED, check_family, moe_families  # noqa: E402
from test_hf_models import transformers_before  # noqa: E402

# the families that swap exactly with transformers 5.25 (the floor this test holds; a family an
# older release lacks is not walked there)
SWAP_EXACTLY = {
    "afmoe", "aria", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "dbrx", "deepseek_ocr2",
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "dots1", "dots3_note", "ernie4_5_moe",
    "ernie4_5_vl_moe", "exaone_moe", "flex_olmo", "flint", "glm4_moe", "glm4_moe_lite",
    "glm4v_moe", "glm5_next", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa",
    "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "hy_v4_vl",
    "inkling2", "inkling2_loop", "jamba", "kimi_linear", "kolibri1", "kolibri1_1", "laguna", "lara_mini", "lfm2_moe", "llama4",
    "longcat_flash", "mellum", "mimo_v2_flash", "minicpm5_moe", "minimax", "minimax_m2",
    "minimax_m3_vl", "mistral4", "mistral_large4", "mixtral", "nemotron_h", "olmoe",
    "openai_privacy_filter", "phimoe", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next",
    "qwen3_omni_moe", "qwen3_vl_moe", "qwen4_exp", "solar_open", "step3p7", "unlimited_ocr",
}  # fmt: skip
# the families whose experts experts_implementation="megamoe" computes exactly with transformers
# 5.25 (their experts run through transformers' experts interface, DBRX's and Llama 4's do not),
# among them families whose blocks do not swap whole
EXPERTS_EXACTLY = (SWAP_EXACTLY - {"dbrx", "llama4"}) | {
    "ergo",
    "gemma4",
    "inkling",
    "muse_spark",
    "zaya",
}
# families of SWAP_EXACTLY that transformers releases before the one given built in a layout
# megamoe does not read, and the tensor of that layout the reason names
OLDER_LAYOUTS = {
    # AriaExperts route inside their own forward, through grouped-GEMM modules fc1 [E, H, 2I]
    # and fc2 [E, I, H]; from 5.18 on they take the routing and hold gate_up_proj and down_proj
    "aria": ("5.18.0", "experts.fc1.weight"),
}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    yield
    transformers.logging.set_verbosity(verbosity)
    transformers.utils.logging.enable_progress_bar()


@pytest.mark.parametrize("family", moe_families())
def test_family_swaps_exactly_or_is_reported_with_the_reason(family):
    if family in NOT_WALKED:
        pytest.skip(f"{family} is {NOT_WALKED[family]}")
    result = check_family(family)  # a family the walk cannot build raises here, with the error
    since, older_layout = OLDER_LAYOUTS.get(family, (None, None))
    if since is not None and transformers_before(since):
        assert result.status == "skipped" and older_layout in result.detail, result.detail
    elif family in SWAP_EXACTLY:
        assert result.status == "swaps exactly", result.detail
    if family in EXPERTS_EXACTLY and not (since is not None and transformers_before(since)):
        assert result.experts_implementation == "exact", result.experts_implementation
    # megamoe's experts implementation computes a family's experts exactly or refuses them
    assert result.experts_implementation in ("exact", "") or (
        result.experts_implementation.startswith("refused: ")
    ), result.experts_implementation
    assert result.status in ("swaps exactly", "skipped"), result.detail
    if result.status == "swaps exactly":
        assert result.logits_error < 1e-5 and result.same_tokens is not False
        assert result.skipped == 0
    else:
        assert result.swapped == 0 and result.skipped > 0 and result.detail
