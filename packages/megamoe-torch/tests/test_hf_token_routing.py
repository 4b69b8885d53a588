"""DeepSeek-V4's blocks: sqrt(softplus) scores, and its hash layers' experts from a table of token
ids (the block's forward takes input_ids), read, swapped and mapped both ways."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels.reference import relative_l2_error

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.deepseek_v4")

from hf_family_walk import tiny_model  # noqa: E402
from megamoe_torch import (  # noqa: E402
    from_hf,
    hf_state_dict_from_megamoe,
    megamoe_state_dict_from_hf,
    swap_moe_blocks,
)
from megamoe_torch.hf.families import moe_blocks  # noqa: E402
from megamoe_torch.hf.reader import read_block  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_model("deepseek_v4")


def _blocks(model):
    """(a hash layer's block, a top-k layer's block)."""
    blocks = [block for _, block in moe_blocks(model)]
    hashed = [block for block in blocks if block.is_hash]
    chosen = [block for block in blocks if not block.is_hash]
    assert hashed and chosen  # the tiny model has both kinds
    return hashed[0], chosen[0]


def test_both_kinds_of_block_read_as_deepseek_v4_computes_them(model):
    hashed, chosen = _blocks(model)
    vocab = model.config.vocab_size
    x = torch.randn(2, 5, model.config.hidden_size)
    input_ids = torch.randint(vocab, (2, 5))
    for block in (hashed, chosen):
        layer = from_hf(block, backend="reference")
        config = layer.config
        assert config.scoring == "sqrtsoftplus" and config.swiglu_limit == 10.0
        assert config.shared_swiglu == "routed"
        assert config.routing_table_vocab_size == (vocab if block is hashed else 0)
        assert config.use_correction_bias == (block is chosen)
        with torch.no_grad():
            expected = block(x, input_ids=input_ids)
            actual = layer(x, input_ids=input_ids)
        assert relative_l2_error(actual, expected) < 1e-5
    assert torch.equal(from_hf(hashed).routing_table, hashed.gate.tid2eid)


def test_the_swapped_blocks_take_the_token_ids_the_decoder_layer_hands_them(model):
    swapped_model = tiny_model("deepseek_v4")
    report = swap_moe_blocks(swapped_model, backend="reference")
    assert len(report.swapped) == len(moe_blocks(model)) and not report.skipped
    hashed, chosen = _blocks(model)
    names = {id(block): name for name, block in moe_blocks(model)}
    x = torch.randn(1, 4, model.config.hidden_size)
    input_ids = torch.randint(model.config.vocab_size, (1, 4))
    for block in (hashed, chosen):
        swapped = swapped_model.get_submodule(names[id(block)])
        with torch.no_grad():
            assert (
                relative_l2_error(swapped(x, input_ids=input_ids), block(x, input_ids=input_ids))
                < 1e-5
            )
        with pytest.raises(TypeError, match=r"inputs \['attention_mask'\] the replaced block"):
            swapped(x, attention_mask=None)
    with pytest.raises(TypeError, match="pass input_ids"):
        swapped_model.get_submodule(names[id(hashed)])(x)


def test_the_routing_table_maps_both_ways(model):
    hashed, _ = _blocks(model)
    hf_state = hashed.state_dict()
    naming = read_block(hashed).naming
    megamoe_state = megamoe_state_dict_from_hf(hf_state, family=naming)
    assert torch.equal(megamoe_state["routing_table"], hf_state["gate.tid2eid"])
    back = hf_state_dict_from_megamoe(megamoe_state, family=naming, layout="fused")
    assert sorted(back) == sorted(hf_state)
    assert all(torch.equal(back[key], hf_state[key]) for key in hf_state)
