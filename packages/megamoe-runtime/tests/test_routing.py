import math
from dataclasses import replace

import pytest
import torch
from megamoe_runtime.routing import RouterConfig, route


def test_softmax_topk_matches_hand_computed_case():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    ids, weights = route(logits, RouterConfig(num_experts=4, top_k=2, renormalize=False))
    exps = [math.exp(v) for v in (1.0, 3.0, 2.0, 0.0)]
    assert ids.tolist() == [[1, 2]]
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    torch.testing.assert_close(weights, torch.tensor([[exps[1], exps[2]]]) / sum(exps))


def test_softmax_renormalized_weights_sum_to_one():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    _, weights = route(logits, RouterConfig(num_experts=4, top_k=2, renormalize=True))
    e3, e2 = math.exp(3.0), math.exp(2.0)
    torch.testing.assert_close(weights, torch.tensor([[e3 / (e3 + e2), e2 / (e3 + e2)]]))


def test_sigmoid_grouped_topk_with_bias_and_scaling_hand_computed():
    # 4 experts in 2 groups of 2; keep 1 group; choose 1 expert; weights are unbiased sigmoids.
    logits = torch.tensor([[0.0, 1.0, 2.0, -3.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0])
    config = RouterConfig(
        num_experts=4,
        top_k=1,
        scoring="sigmoid",
        num_groups=2,
        top_groups=1,
        routed_scaling_factor=2.5,
        renormalize=False,
        use_correction_bias=True,
    )
    s = torch.sigmoid(logits)
    # group 0 score = s0 + s1 = 0.5 + 0.731; group 1 = s2 + s3 = 0.881 + 0.047: group 0 wins
    ids, weights = route(logits, config, correction_bias_E=bias)
    assert ids.tolist() == [[1]]
    torch.testing.assert_close(weights, 2.5 * s[:, 1:2])
    # a bias large enough moves the choice inside the kept group but weights stay unbiased
    ids, weights = route(logits, config, correction_bias_E=torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert ids.tolist() == [[0]]
    torch.testing.assert_close(weights, 2.5 * s[:, 0:1])


def test_sigmoid_renormalized_then_scaled():
    logits = torch.randn(5, 8)
    config = RouterConfig(num_experts=8, top_k=3, scoring="sigmoid", routed_scaling_factor=2.0)
    _, weights = route(logits, config)
    torch.testing.assert_close(weights.sum(-1), torch.full((5,), 2.0))


def test_sqrtsoftplus_hand_computed():
    # DeepSeek-V4: sqrt(softplus(l)) scores, the bias for the choice only, + 1e-20, scaled
    logits = torch.tensor([[0.0, 2.0, -1.0, 30.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, -40.0])
    config = RouterConfig(
        num_experts=4,
        top_k=2,
        scoring="sqrtsoftplus",
        use_correction_bias=True,
        routed_scaling_factor=1.5,
    )
    ids, weights = route(logits, config, correction_bias_E=bias)
    scores = [math.sqrt(math.log1p(math.exp(v))) for v in (0.0, 2.0, -1.0)] + [math.sqrt(30.0)]
    # biased choice scores: 0.83, 1.46, 5.56, 5.48 - 40: experts 2 then 1
    assert ids.tolist() == [[2, 1]]
    chosen = [scores[2], scores[1]]
    expected = torch.tensor([[1.5 * v / (sum(chosen) + 1e-20) for v in chosen]])
    torch.testing.assert_close(weights, expected)


def test_sqrtsoftplus_scores_take_the_logit_itself_above_20():
    # torch's softplus threshold: softplus(l) = l for l > 20, log1p(exp(l)) below
    logits = torch.tensor([[20.5, 19.5, -200.0, float("-inf")]])
    config = RouterConfig(num_experts=4, top_k=4, scoring="sqrtsoftplus", renormalize=False)
    ids, weights = route(logits, config)
    order = ids.long().sort(dim=-1)
    assert order.values.tolist() == [[0, 1, 2, 3]]
    expected = [math.sqrt(20.5), math.sqrt(math.log1p(math.exp(19.5))), 0.0, 0.0]
    torch.testing.assert_close(weights.gather(1, order.indices), torch.tensor([expected]))


def test_sqrtsoftplus_matches_deepseek_v4s_router():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    config = transformers.DeepseekV4Config(
        hidden_size=32, num_local_experts=16, num_experts_per_tok=4, routed_scaling_factor=1.5
    )
    torch.manual_seed(0)
    router = v4.DeepseekV4TopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(64, 32)
    logits, hf_weights, hf_ids = router(x)
    ids, weights = route(
        logits,
        RouterConfig(
            num_experts=16,
            top_k=4,
            scoring="sqrtsoftplus",
            use_correction_bias=True,
            routed_scaling_factor=1.5,
        ),
        correction_bias_E=router.e_score_correction_bias,
    )
    # transformers leaves its top-k unsorted: compare each token's experts as sets
    hf_order = hf_ids.sort(dim=-1)
    order = ids.long().sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices)
    )


def test_softmax_with_correction_bias_chooses_on_biased_probabilities():
    # ERNIE 4.5: the bias moves the choice, the weights stay the unbiased probabilities
    logits = torch.randn(6, 8)
    bias = torch.zeros(8)
    bias[5] = 2.0  # every token picks expert 5 first
    config = RouterConfig(num_experts=8, top_k=2, renormalize=False, use_correction_bias=True)
    ids, weights = route(logits, config, correction_bias_E=bias)
    probabilities = torch.softmax(logits, dim=-1)
    assert (ids[:, 0] == 5).all()
    torch.testing.assert_close(weights, probabilities.gather(1, ids.long()))


def test_softmax_renormalized_equals_softmax_over_the_top_k_logits():
    logits = torch.randn(9, 16) * 3
    ids, weights = route(logits, RouterConfig(num_experts=16, top_k=4))
    top_logits, top_ids = logits.topk(4, dim=-1)
    assert torch.equal(ids.long(), top_ids)
    torch.testing.assert_close(weights, torch.softmax(top_logits, dim=-1))


def test_group_score_max_keeps_the_groups_of_the_best_experts():
    # DeepSeek-V2 group-limited greedy: 8 experts in 4 groups, a group scored by its best expert
    logits = torch.tensor([[5.0, -9.0, 3.5, 3.4, 0.0, 0.0, 4.0, -9.0]])
    config = RouterConfig(
        num_experts=8, top_k=2, num_groups=4, top_groups=2, renormalize=False, group_score="max"
    )
    ids, _ = route(logits, config)
    assert sorted(ids[0].tolist()) == [0, 6]  # groups 0 (max 5) and 3 (max 4) are kept
    top2_sum = RouterConfig(num_experts=8, top_k=2, num_groups=4, top_groups=2, renormalize=False)
    ids, _ = route(logits, top2_sum)
    assert sorted(ids[0].tolist()) == [0, 2]  # group 1 (3.5, 3.4) outranks group 3 (4, -9)


def test_choice_on_logits_adds_the_bias_to_the_logits_and_weights_with_the_scores():
    # Kolibri: the choice is logits + bias, the weights sigmoid(logits) of the chosen experts
    logits = torch.randn(16, 8) * 3
    bias = torch.randn(8)
    config = RouterConfig(
        num_experts=8,
        top_k=3,
        scoring="sigmoid",
        renormalize=False,
        use_correction_bias=True,
        choice_on_logits=True,
    )
    ids, weights = route(logits, config, correction_bias_E=bias)
    expected_ids = (logits + bias).topk(3, dim=-1).indices
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, torch.sigmoid(logits).gather(1, expected_ids))
    on_scores = route(logits, replace(config, choice_on_logits=False), correction_bias_E=bias)[0]
    assert not torch.equal(on_scores, ids)  # the bias moves other experts in on the scores


def test_sparsemixer_hand_computed():
    # logits 4, 3.99, 1, -2; eps 0.01: round 1 takes expert 0 and keeps the logits within a
    # relative gap of 0.02 below 4 (expert 1: 0.01 / 4); round 2 takes expert 1 alone (expert 0
    # taken, expert 2: 2.99 / 3.99 past 0.02), weight 1
    config = RouterConfig(num_experts=4, top_k=2, scoring="sparsemixer", renormalize=False)
    logits = torch.tensor([[4.0, 3.99, 1.0, -2.0]])
    ids, weights = route(logits, config)
    assert ids.tolist() == [[0, 1]]
    first = torch.softmax(torch.tensor([4.0, 3.99]), 0)[0]
    torch.testing.assert_close(weights, torch.stack([first, torch.tensor(1.0)]).view(1, 2))


@pytest.mark.parametrize("experts", [4, 16, 60])
@pytest.mark.parametrize("eps", [0.01, 0.3, 0.0])
def test_sparsemixer_matches_phimoe_at_inference(experts, eps):
    phimoe = pytest.importorskip("transformers.models.phimoe.modeling_phimoe")
    generator = torch.Generator().manual_seed(experts)
    # spread logits and crowded ones (every logit within the gap of the largest)
    for scale in (3.0, 0.001):
        logits = scale * torch.randn(257, experts, generator=generator) + 1.0
        weights_hf, ids_hf = phimoe.sparsemixer(logits, jitter_eps=eps, training=False, top_k=2)
        config = RouterConfig(
            num_experts=experts,
            top_k=2,
            scoring="sparsemixer",
            renormalize=False,
            sparsemixer_eps=eps,
        )
        ids, weights = route(logits, config)
        assert torch.equal(ids.long(), ids_hf)
        assert torch.equal(weights, weights_hf)


def test_top_k_equal_to_num_experts_takes_every_expert():
    ids, weights = route(torch.randn(3, 4), RouterConfig(num_experts=4, top_k=4))
    assert sorted(ids[0].tolist()) == [0, 1, 2, 3]
    torch.testing.assert_close(weights.sum(-1), torch.ones(3))


def test_zero_tokens():
    ids, weights = route(torch.randn(0, 6), RouterConfig(num_experts=6, top_k=2))
    assert ids.shape == (0, 2) and weights.shape == (0, 2)


def test_nan_logits_poison_only_their_token_and_check_finite_raises():
    logits = torch.randn(3, 4)
    logits[1, 2] = float("nan")
    ids, weights = route(logits, RouterConfig(num_experts=4, top_k=2))
    assert torch.isnan(weights[1]).any()
    assert torch.isfinite(weights[[0, 2]]).all()
    assert ((ids >= 0) & (ids < 4)).all()
    with pytest.raises(ValueError, match="NaN or Inf"):
        route(logits, RouterConfig(num_experts=4, top_k=2), check_finite=True)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(num_experts=4, top_k=5), "top_k"),
        (dict(num_experts=4, top_k=0), "top_k"),
        (dict(num_experts=6, top_k=2, num_groups=4), "num_groups"),
        (dict(num_experts=8, top_k=2, num_groups=2, top_groups=3), "top_groups"),
        (dict(num_experts=8, top_k=5, num_groups=2, top_groups=1), "exceeds"),
        (dict(num_experts=4, top_k=1, scoring="relu"), "scoring"),
        (dict(num_experts=4, top_k=1, num_groups=2, group_score="min"), "group_score"),
        (dict(num_experts=4, top_k=1, num_groups=4), "two best"),
        (dict(num_experts=8, top_k=3, scoring="sparsemixer"), "top_k != 2"),
        (dict(num_experts=8, top_k=2, scoring="sparsemixer", num_groups=2), "grouped top-k"),
        (
            dict(num_experts=8, top_k=2, scoring="sparsemixer", use_correction_bias=True),
            "a correction bias",
        ),
        (dict(num_experts=8, top_k=2, scoring="sparsemixer", sparsemixer_eps=-0.1), "eps"),
    ],
)
def test_bad_router_config_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(num_experts="8", top_k=2), "num_experts must be an int, got '8'"),
        (dict(num_experts=8, top_k=2.5), "top_k must be an int, got 2.5"),
        (dict(num_experts=8, top_k=2, num_groups=True), "num_groups must be an int, got True"),
    ],
)
def test_router_config_counts_are_ints(fields, message):
    with pytest.raises(TypeError, match=message):
        RouterConfig(**fields)


def test_bad_logits_shape_and_missing_bias_are_refused():
    config = RouterConfig(num_experts=4, top_k=1)
    with pytest.raises(ValueError, match="num_experts=4"):
        route(torch.randn(2, 5), config)
    with pytest.raises(TypeError, match="floating point"):
        route(torch.ones(2, 4, dtype=torch.int64), config)
    biased = RouterConfig(num_experts=4, top_k=1, scoring="sigmoid", use_correction_bias=True)
    with pytest.raises(ValueError, match="correction_bias"):
        route(torch.randn(2, 4), biased)


@pytest.mark.parametrize(
    "fields, rule",
    [
        (dict(num_experts=128, top_k=8), dict(scoring="softmax", group_by_max=False)),
        (
            dict(num_experts=64, top_k=6, use_correction_bias=True, routed_scaling_factor=2.0),
            dict(scoring="softmax", scaling=2.0),
        ),
        (
            dict(num_experts=160, top_k=6, num_groups=8, top_groups=3, group_score="max"),
            dict(num_groups=8, top_groups=3, group_by_max=True),
        ),
        (
            dict(
                num_experts=40,
                top_k=4,
                scoring="sigmoid",
                use_correction_bias=True,
                choice_on_logits=True,
                num_groups=4,
                dropped_group_score=0.0,
            ),
            dict(scoring="sigmoid", choice_on_logits=True, dropped_score=0.0, group_by_max=False),
        ),
        (
            dict(num_experts=16, top_k=2, scoring="sparsemixer", sparsemixer_eps=0.3),
            dict(scoring="sparsemixer", sparsemixer_eps=0.3),
        ),
        (
            dict(num_experts=64, top_k=6, scoring="sqrtsoftplus", use_correction_bias=True),
            dict(scoring="sqrtsoftplus", choice_on_logits=False),
        ),
    ],
)
def test_every_router_reaches_the_routing_kernels_as_its_rule(fields, rule):
    # the device routing kernels compute every RouterConfig: the rule they are compiled for
    from megamoe_kernels.shim.local_layer import RouteLauncher
    from megamoe_runtime.dispatch.device_routed import route_launcher_constants

    router = RouterConfig(**fields)
    launcher = RouteLauncher(**route_launcher_constants(router), hidden_size=64, compile_only=True)
    assert launcher.rule.num_experts == router.num_experts
    assert launcher.rule.top_k == router.top_k
    assert launcher.rule.renormalize == router.renormalize
    for name, value in rule.items():
        assert getattr(launcher.rule, name) == value, name
