"""Every MoE family of the installed transformers: a tiny random model of each, swapped and checked.

`check_family(name)` builds a tiny random model of one transformers model package whose modeling
code holds routed experts, swaps its MoE blocks for megamoe (backend "reference") and compares the
fp32 logits and greedy generate() with the unswapped model. test_hf_families.py runs it for every
family; run this file to print the family table of docs/huggingface.md:

    python packages/megamoe-torch/tests/hf_family_walk.py [family ...]

Tiny configs are generic (every size field the config has, shrunk) plus what a family's config
validation asks for (`FAMILY_FIELDS`); each model keeps every kind of layer its default config has.
"""

from __future__ import annotations

import copy
import glob
import importlib
import inspect
import json
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass

import torch
from megamoe_kernels.reference import relative_l2_error

VOCAB = 128
# families whose models are not decoders: their MoE blocks are not walked
NOT_WALKED = {
    "diffusion_gemma": "an encoder-decoder diffusion model",
    "nllb_moe": "an encoder-decoder translation model",
    "switch_transformers": "an encoder-decoder (T5) model",
    "vitpose_backbone": "a vision backbone",
}
# walked, on logits alone (no generate()), and not counted among the decoder-only families
NOT_DECODER_ONLY = {"openai_privacy_filter": "a bidirectional encoder (token classification)"}
# size fields of any config, set where the config has them
SMALL_FIELDS = dict(
    vocab_size=VOCAB,
    unpadded_vocab_size=VOCAB,
    hidden_size=64,
    d_model=64,
    num_hidden_layers=2,
    n_layers=2,
    num_layers=2,
    num_attention_heads=4,
    n_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    moe_intermediate_size=32,
    expert_ffn_hidden_size=32,
    ffn_hidden_size=64,
    shared_expert_intermediate_size=48,
    shared_experts_intermediate_size=48,
    moe_shared_expert_intermediate_size=48,
    shared_intermediate_size=48,
    dense_intermediate_size=64,
    intermediate_size_mlp=64,
    share_expert_dim=48,
    moe_hidden_size=32,
    num_experts=8,
    num_local_experts=8,
    n_routed_experts=8,
    moe_num_experts=8,
    num_experts_per_tok=2,
    moe_topk=2,
    moe_k=2,
    max_position_embeddings=256,
    max_seq_len=256,
    kv_lora_rank=16,
    q_lora_rank=32,
    o_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    index_topk=8,
    index_head_dim=16,
    index_n_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_head_dim=16,
    linear_num_heads=4,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=16,
    mamba_chunk_size=16,
    chunk_size=16,
    sliding_window=8,
    attention_chunk_size=8,
    router_hidden_size=16,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB,
    # vision and audio towers: built, never run on text-only inputs
    depth=1,
    out_hidden_size=64,
    encoder_layers=1,
    encoder_ffn_dim=32,
    encoder_attention_heads=2,
    output_dim=64,
    projector_hidden_size=64,
    num_heads=4,
    # per-layer overrides of the sizes (heterogeneous layers): every layer takes the small ones
    per_layer_config={},
)
# what a family's config validation or modeling code needs beyond the generic sizes
FAMILY_FIELDS: dict[str, dict] = {
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2},
    },
    "deepseek_ocr2": {"text_config.mlp_layer_types": ["dense", "sparse"]},
    "dots1": {"n_shared_experts": 1},
    "ernie4_5_vl_moe": {
        "text_config.moe_intermediate_size": [32, 16],
        # the rotary sections of the (16-dim) heads' frequencies: height + width, time
        "text_config.rope_parameters": {
            "rope_type": "default",
            "rope_theta": 500000.0,
            "mrope_section": [3, 3, 2],
        },
    },
    "flint": {"mlp_only_layers": []},
    "doge": {"is_moe": True, "num_experts": 16},  # product-key routing: a square expert count
    "gemma4": {"enable_moe_block": True, "top_k_experts": 2},
    "glm4v_moe": {
        "text_config.rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
        },
    },
    "glm5_next": {"text_config.index_topk": 16},
    # an infinite time_step_limit does not survive config.json (transformers writes it as a dict)
    "granitemoehybrid": {"layer_types": ["attention", "mamba"], "time_step_limit": [0.0, 1e4]},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 0,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    # its indexer heads read the query heads of one key head (4 / 2 in the tiny model)
    "kolibri1_1": {"index_num_heads": 2},
    "lfm2_moe": {"layer_types": ["full_attention", "conv"], "num_dense_layers": 0},
    # 4 zero-computation experts beside the 8 routed ones (the default's 256 leave the tiny
    # model's probe tokens no routed expert)
    "longcat_flash": {"zero_expert_num": 4},
    # an infinite time_step_limit does not survive config.json (as for granitemoehybrid)
    "nemotron_h": {"time_step_limit": [0.0, 1e4]},
    "muse_spark": {
        "audio_config": {
            "hidden_sizes": [8, 8, 8, 16],
            "depths": [1, 1, 1, 1],
            "num_hidden_layers": 4,
            "out_hidden_size": 64,
        }
    },
    # the thinker reads this token id, which only the full Qwen3-Omni config holds
    "qwen3_omni_moe": {"vision_start_token_id": 151652},
    "qwen4_exp": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    "zaya": {"num_experts_per_tok": 1},
}
PARAMETER_LIMIT = 20_000_000


def moe_families() -> list[str]:
    """The transformers model packages whose modeling code builds routed experts."""
    import transformers

    models = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = []
    for directory in sorted(glob.glob(os.path.join(models, "*"))):
        source = ""
        for path in glob.glob(os.path.join(directory, "modeling_*.py")):
            with open(path) as file:
                source += file.read()
        if re.search(r"self\.experts\s*=|class \w*(MoE|Experts)\w*\(nn\.Module\)", source):
            found.append(os.path.basename(directory))
    return found


def decoder_families() -> list[str]:
    """The decoder-only MoE families: the ones the family table counts."""
    excluded = NOT_WALKED.keys() | NOT_DECODER_ONLY.keys()
    return [family for family in moe_families() if family not in excluded]


def _model_class(family: str) -> type:
    """The family's text-generating model class (a causal LM, else a conditional generation or
    token classification model, run on text alone)."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    classes = [
        value
        for name, value in vars(module).items()
        if inspect.isclass(value) and value.__module__ == module.__name__
    ]
    for suffix in ("ForCausalLM", "ForConditionalGeneration", "ForTokenClassification"):
        candidates = [
            c
            for c in classes
            if c.__name__.endswith(suffix) and not re.search("Talker|Code", c.__name__)
        ]
        if candidates:  # Qwen3-Omni: the thinker is the text model
            return min(candidates, key=lambda c: ("Thinker" not in c.__name__, len(c.__name__)))
    raise LookupError(f"transformers.models.{family} has no text-generating model class")


def _tiny_fields(config_class: type) -> dict:
    """Small values for `config_class`'s size fields, and its per-layer lists cut to one layer of
    each kind (so every kind of layer is built), recursively for its sub-configs."""
    default = config_class().to_dict()
    # a size of 0 switches a part off: kept so
    fields = {
        key: value for key, value in SMALL_FIELDS.items() if key in default and default[key] != 0
    }
    layer_key = next(
        (k for k in ("num_hidden_layers", "n_layers", "num_layers") if k in default), None
    )
    layers = default.get(layer_key) if layer_key else None
    per_layer = {
        key: value
        for key, value in default.items()
        if isinstance(value, list) and layers and len(value) == layers and key not in SMALL_FIELDS
    }
    if per_layer:
        kinds, chosen = set(), []
        for index in range(layers):
            kind = tuple(str(per_layer[key][index]) for key in sorted(per_layer))
            if kind not in kinds:
                kinds.add(kind)
                chosen.append(index)
        chosen = chosen[:4] if len(chosen) > 1 else [0, 1][:layers]
        fields.update({key: [value[i] for i in chosen] for key, value in per_layer.items()})
        fields[layer_key] = len(chosen)
    if "qk_rope_head_dim" in default:  # multi-head latent attention: head_dim as the default has it
        rope, nope = fields.get("qk_rope_head_dim", 0), fields.get("qk_nope_head_dim", 0)
        if default.get("head_dim") == default["qk_rope_head_dim"]:
            fields["head_dim"] = rope
        elif default.get("head_dim") == default["qk_rope_head_dim"] + (
            default.get("qk_nope_head_dim") or 0
        ):
            fields["head_dim"] = rope + nope
        if "num_key_value_heads" in fields:
            fields["num_key_value_heads"] = fields["num_attention_heads"]
    for count, kept in (("n_group", "topk_group"), ("num_expert_group", "topk_group")):
        if (default.get(count) or 1) > 1:
            fields.update({count: 4, kept: 2})
    if "first_k_dense_replace" in default:
        fields["first_k_dense_replace"] = min(default["first_k_dense_replace"] or 0, 1)
    for key, small in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        value = default.get(key)
        if isinstance(value, list) or (isinstance(value, int) and value >= VOCAB):
            fields[key] = small
    rope = default.get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" in rope:
        rotary = fields.get("qk_rope_head_dim", fields.get("head_dim", 16)) // 2
        section = [rotary // 4, rotary // 4]
        fields["rope_parameters"] = {**rope, "mrope_section": [rotary - sum(section), *section]}
    for name, sub_config in (getattr(config_class, "sub_configs", None) or {}).items():
        if name in ("talker_config", "code2wav_config"):  # Qwen3-Omni's speech output
            continue
        if sub_config.__name__ == "AutoConfig":  # the default's own class, named by model_type
            sub_config = type(getattr(config_class(), name))
            fields[name] = {"model_type": sub_config.model_type, **_tiny_fields(sub_config)}
        else:
            fields[name] = _tiny_fields(sub_config)
    return fields


def tiny_model(family: str) -> torch.nn.Module:
    """A tiny random model of `family` in eval mode, fp32, with decisive routing."""
    model_class = _model_class(family)
    fields = _tiny_fields(model_class.config_class)
    for key, value in FAMILY_FIELDS.get(family, {}).items():
        parent = fields
        *path, leaf = key.split(".")
        for name in path:
            parent = parent.setdefault(name, {})
        parent[leaf] = value
    config = model_class.config_class(**fields)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in model_class(config).parameters())
    if parameters > PARAMETER_LIMIT:
        raise RuntimeError(f"the tiny {family} model has {parameters / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        # larger than transformers' init so routing is decisive and every expert matters
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.3 if re.search("gate|router", name) else 0.08)
            elif re.search("bias|statics", name):
                parameter.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if re.search("correction_bias|statics", name):
                buffer.normal_(0.0, 0.2)  # negative entries included: group masking matters
            if name.endswith("tid2eid"):  # DeepSeek-V4's table of each token id's experts
                experts = getattr(config, "num_local_experts", None) or buffer.max().item() + 1
                rows = torch.rand(buffer.shape[0], experts).argsort(dim=1)
                buffer.copy_(rows[:, : buffer.shape[1]])
    return model


@dataclass(frozen=True)
class FamilyResult:
    family: str
    # "swaps exactly", "skipped", or "not walked"
    status: str
    # what the swapped blocks compute, or why they were skipped
    detail: str
    swapped: int = 0
    skipped: int = 0
    logits_error: float | None = None
    same_tokens: bool | None = None
    # whether from_hf_state_dict reads the checkpoint save_pretrained writes ("read"), or why not
    checkpoint_on_disk: str | None = None
    # the model run with experts_implementation="megamoe": "exact" (logits within 1e-5 of
    # "eager"), why megamoe refuses its experts, or "" where its experts do not run through
    # transformers' experts interface
    experts_implementation: str = ""


def check_family(family: str) -> FamilyResult:
    """Swaps a tiny random model of `family` and compares it with the unswapped model: fp32
    logits, greedy generate(), the state dict, save_pretrained + from_pretrained of the original
    class, and from_hf_state_dict of the saved checkpoint against the block it holds."""
    from megamoe_torch import swap_moe_blocks

    if family in NOT_WALKED:
        return FamilyResult(family, "not walked", NOT_WALKED[family])
    experts_implementation = check_experts_implementation(family)
    model = tiny_model(family)
    original = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = swap_moe_blocks(model, backend="reference")
    swapped, skipped = len(report.swapped), len(report.skipped)
    if not report.swapped:
        reasons = sorted({entry.reason for entry in report.skipped}) or ["no MoE block found"]
        return FamilyResult(
            family,
            "skipped",
            "; ".join(reasons),
            swapped,
            skipped,
            experts_implementation=experts_implementation,
        )
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (2, 7), generator=generator)
    with torch.no_grad():
        expected_logits = original(input_ids).logits
        error = relative_l2_error(model(input_ids).logits, expected_logits)
    same_tokens = None
    if model.can_generate():
        prompt = torch.randint(3, VOCAB, (1, 4), generator=generator)
        options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        same_tokens = torch.equal(
            model.generate(prompt, **options), original.generate(prompt, **options)
        )
    problems = []
    if error >= 1e-5:
        problems.append(f"logits differ by {error:.2e}")
    if same_tokens is False:
        problems.append("generate() gives other tokens")
    checkpoint_problems, on_disk = _checkpoint_problems(
        model, original, report, input_ids, expected_logits
    )
    problems += checkpoint_problems
    if report.skipped:
        reasons = sorted({entry.reason for entry in report.skipped})
        problems.append("skipped: " + "; ".join(reasons))
    detail = "; ".join(sorted({entry.computes for entry in report.swapped}))
    return FamilyResult(
        family,
        "differs" if problems else "swaps exactly",
        "; ".join([detail, *problems]),
        swapped,
        skipped,
        logits_error=error,
        same_tokens=same_tokens,
        checkpoint_on_disk="read" if on_disk is None else on_disk,
        experts_implementation=experts_implementation,
    )


def check_experts_implementation(family: str) -> str:
    """A tiny random model of `family` run with experts_implementation="megamoe" (the reference
    backend) against "eager", on the same tokens: "exact" within 1e-5 rel-L2, why megamoe
    refuses its experts, or "" where its experts do not run through the experts interface."""
    from megamoe_torch import UnsupportedBlockError, register_experts_implementation

    register_experts_implementation(backend="reference")
    model = tiny_model(family)
    # the experts classes transformers' experts interface runs carry its flags
    if not any(hasattr(module, "is_concatenated") for module in model.modules()):
        return ""
    input_ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        expected = model(input_ids).logits
        model.set_experts_implementation("megamoe")
        try:
            actual = model(input_ids).logits
        except UnsupportedBlockError as error:
            return f"refused: {error}"
    error = relative_l2_error(actual, expected)
    return "exact" if error < 1e-5 else f"differs by {error:.1e}"


def _checkpoint_problems(
    model, original, report, input_ids, expected_logits
) -> tuple[list[str], str | None]:
    """(what differs in the swapped model's checkpoint: its state dict against the original's,
    the original class loading it, the first MoE block read back by from_hf_state_dict from the
    model's in-memory tensors; why from_hf_state_dict cannot read the checkpoint as saved, or
    None when it can)."""
    import safetensors.torch
    from megamoe_torch import from_hf_state_dict

    problems = []
    state, original_state = model.state_dict(), original.state_dict()
    if sorted(state) != sorted(original_state) or not all(
        torch.equal(state[key], original_state[key]) for key in original_state
    ):
        problems.append("the swapped model's state dict is not the original's")
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        loaded, info = type(original).from_pretrained(directory, output_loading_info=True)
        if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
            problems.append(f"from_pretrained of the saved model: {info}")
        with torch.no_grad():
            reloaded_error = relative_l2_error(loaded.eval()(input_ids).logits, expected_logits)
        if reloaded_error >= 1e-5:
            problems.append(f"the reloaded model's logits differ by {reloaded_error:.2e}")
        checkpoint = {}
        for path in glob.glob(os.path.join(directory, "*.safetensors")):
            checkpoint.update(safetensors.torch.load_file(path))
        with open(os.path.join(directory, "config.json")) as file:
            config_json = json.load(file)
    name = report.swapped[0].name  # the block from_hf_state_dict reads for its layer
    layer = int(re.search(r"\.(\d+)\.", f".{name}.").group(1))
    block = original.get_submodule(name)
    x = torch.randn(1, 5, model.get_submodule(name).config.hidden_size)  # the swapped block
    # the token ids, for a block that takes them (DeepSeek-V4's, whose hash layers route by them)
    inputs = {}
    if "input_ids" in inspect.signature(type(block).forward).parameters:
        inputs["input_ids"] = torch.randint(VOCAB, (1, 5))
    with torch.no_grad():
        expected = block(x, **inputs)
        expected = expected[0] if isinstance(expected, tuple) else expected
    reads = {}
    for names, tensors in (("on disk", checkpoint), ("in memory", original_state)):
        try:
            from_checkpoint = from_hf_state_dict(tensors, config_json, layer=layer)
        except (ValueError, ImportError) as error:
            reads[names] = f"{type(error).__name__}: {error}"
            continue
        with torch.no_grad():
            actual = from_checkpoint(x, **inputs).reshape(expected.shape)
        block_error = relative_l2_error(actual, expected)
        reads[names] = (
            None if block_error < 1e-5 else f"differs from the block by {block_error:.2e}"
        )
    if reads["in memory"] is not None:
        problems.append(f"from_hf_state_dict of the in-memory tensors: {reads['in memory']}")
    return problems, reads["on disk"]


def family_table(results: list[FamilyResult]) -> str:
    """The markdown table of docs/huggingface.md: a row per family."""
    lines = [
        "| family | status | what megamoe computes, or why it is skipped | checkpoint on disk "
        '| experts_implementation="megamoe" |',
        "|---|---|---|---|---|",
    ]
    for result in results:
        detail = result.detail.replace("|", "\\|")
        if result.family in NOT_DECODER_ONLY:
            detail += f" ({NOT_DECODER_ONLY[result.family]}: logits compared, no generate())"
        on_disk = {None: "", "read": "read"}.get(result.checkpoint_on_disk, "in-memory names")
        experts = result.experts_implementation.replace("|", "\\|")
        lines.append(f"| {result.family} | {result.status} | {detail} | {on_disk} | {experts} |")
    return "\n".join(lines)


def summary(results: list[FamilyResult], transformers_version: str) -> str:
    decoders = set(decoder_families())
    exact = [r.family for r in results if r.status == "swaps exactly" and r.family in decoders]
    walked = [r.family for r in results if r.family in decoders]
    experts = [
        r.family
        for r in results
        if r.experts_implementation == "exact" and r.status != "swaps exactly"
        if r.family in decoders
    ]
    return (
        f"transformers {transformers_version}: {len(exact)} of the {len(walked)} decoder-only MoE "
        f'families swap exactly; experts_implementation="megamoe" computes the experts of '
        f"{len(experts)} more ({', '.join(experts) or 'none'})"
    )


if __name__ == "__main__":
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    results = []
    for name in sys.argv[1:] or moe_families():
        try:
            results.append(check_family(name))
        except Exception as error:  # a family this walk cannot build: its row says why
            results.append(FamilyResult(name, "not built", f"{type(error).__name__}: {error}"))
    print(summary(results, transformers.__version__) + "\n")
    print(family_table(results))
