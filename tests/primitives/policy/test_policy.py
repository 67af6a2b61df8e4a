"""PruneNet policy learner: Eqs. 3–7, Algorithm 1, applying kept rows to a model, save/load, ratio schedules."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import build_groups
from slimkit.primitives.policy.prunenet import (
    RETURNS,
    SELECTIONS,
    UPDATES,
    PruneNetPolicy,
    discounted_penalties,
    ffn_weights,
    layer_penalties,
    layer_ratios,
    load_policy,
    policy_keep_indices,
    reparameterize,
    save_policy,
    sequential_log_prob,
    train_policy,
)
from slimkit.primitives.spectrum import ks_distance
from slimkit.primitives.surgery.units import remove_units


def test_reparameterisation_thresholds_to_bernoulli():
    # Appendix C.3: with W_imp = alpha, W̃ > 0.5 happens with probability alpha.
    g = torch.Generator().manual_seed(0)
    draws = 20_000
    for alpha in (0.1, 0.5, 0.85):
        logits = torch.full((draws,), math.log(alpha / (1 - alpha)))
        w_tilde = reparameterize(logits, torch.rand(draws, generator=g))
        assert float((w_tilde > 0.5).float().mean()) == pytest.approx(alpha, abs=0.015)


def test_sequential_log_prob_is_a_distribution_over_ordered_draws():
    log_p = torch.log(torch.tensor([0.5, 0.2, 0.2, 0.1]))
    for k in (1, 2, 4):
        total = sum(
            math.exp(sequential_log_prob(log_p, torch.tensor(order))) for order in itertools.permutations(range(4), k)
        )
        assert total == pytest.approx(1.0)
    # P(draw 0 then 1) = 0.5 * 0.2 / (1 - 0.5)
    assert math.exp(sequential_log_prob(log_p, torch.tensor([0, 1]))) == pytest.approx(0.2)


@pytest.mark.parametrize("selection", SELECTIONS)
def test_keep_indices_are_distinct_sorted_and_sized(selection):
    policy = PruneNetPolicy(40, 12, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(40, 12)
    g = torch.Generator().manual_seed(1)
    for ratio in (0.0, 0.1, 0.25, 0.5, 0.9):
        keep = policy_keep_indices(policy, weight, ratio, selection, g)
        assert keep.dtype == torch.long and keep.numel() == round(40 * (1 - ratio))
        assert torch.equal(keep, keep.unique(sorted=True))
        assert 0 <= int(keep.min()) and int(keep.max()) < 40


def test_deterministic_selection_is_top_k_of_importance():
    policy = PruneNetPolicy(16, 4, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(16, 4)
    importance = policy(weight)
    assert importance.shape == (16,) and bool(((importance > 0) & (importance < 1)).all())
    keep = policy_keep_indices(policy, weight, 0.5, "deterministic")
    assert set(keep.tolist()) == set(torch.topk(importance, 8).indices.tolist())


def test_importance_follows_rows():
    # One score per row of W (W_imp = σ(W_proj W'ᵀ)): permuting W's rows permutes the scores.
    policy = PruneNetPolicy(10, 6, generator=torch.Generator().manual_seed(0))
    weight, perm = torch.randn(10, 6), torch.randperm(10)
    torch.testing.assert_close(policy(weight[perm]), policy(weight)[perm])
    materialised = torch.sigmoid(policy.w_proj @ (weight @ policy.w_inter.T).T).squeeze(0)
    torch.testing.assert_close(policy(weight), materialised)


def _toy_weights(layers: int = 3, n: int = 8) -> list[torch.Tensor]:
    # d = 1: the spectrum is the column norm, unchanged (D = 0) only if row 0 is kept, else D = 1.
    weights = []
    for _ in range(layers):
        w = torch.zeros(n, 1)
        w[0, 0] = 1.0
        weights.append(w)
    return weights


def _keep_rate(policy, weight, trials=400):
    g = torch.Generator().manual_seed(123)
    return sum(0 in policy_keep_indices(policy, weight, 0.5, "policy", g).tolist() for _ in range(trials)) / trials


@pytest.fixture
def one_thread():
    # Hundreds of tiny ops: intra-op threads only add overhead (and stall on a busy machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize(("returns", "update"), [("to_go", "episode"), ("own", "episode"), ("own", "layer")])
def test_reinforce_learns_to_keep_the_row_that_lowers_the_penalty(one_thread, returns, update):
    weights = _toy_weights()
    start = PruneNetPolicy(8, 1, generator=torch.Generator().manual_seed(0))
    before_importance, before_rate = float(start(weights[0])[0].detach()), _keep_rate(start, weights[0])
    policy, report = train_policy(weights, 0.5, episodes=200, lr=0.05, seed=0, returns=returns, update=update)
    after_importance, after_rate = float(policy(weights[0])[0].detach()), _keep_rate(policy, weights[0])
    assert after_importance > before_importance + 0.3
    # The other rows' W̃ stays ~ε (their W_imp is pinned at 0.5 here), so even W_imp -> 1 keeps
    # row 0 in only ~80% of draws of 4 of 8: the sampled W̃ never becomes a hard choice.
    assert after_rate > before_rate + 0.15
    assert len(report.episode_penalty) == 200 and set(report.layer_penalty[0]) <= {0.0, 1.0}


def test_returns_of_three_layers_by_hand():
    # Three layers whose kept spectra have KS distances 1/4, 1/2 and 1 to the full ones (Eq. 6).
    full = torch.tensor([1.0, 2.0, 3.0, 4.0])
    penalties = [
        ks_distance(full, torch.tensor([1.0, 2.0, 3.0, 5.0])),  # F differs only on [4, 5): 1/4
        ks_distance(full, torch.tensor([1.0, 2.0, 5.0, 6.0])),  # on [4, 5): 1 - 2/4
        ks_distance(full, torch.tensor([5.0, 6.0, 7.0, 8.0])),  # disjoint: 1
    ]
    assert penalties == [0.25, 0.5, 1.0]
    gamma = 0.5
    # Eq. 7 / Algorithm 1 line 19 as printed: G_l = Σ_k γ^k D_{l+k+1}; nothing of the layer's own D.
    assert discounted_penalties(penalties, gamma, "future") == [0.5 + 0.5 * 1.0, 1.0, 0.0]
    # The released code's _discount_rewards: G_l = γ^l D_l, l from 0.
    assert discounted_penalties(penalties, gamma, "own") == [0.25, 0.5 * 0.5, 0.25 * 1.0]
    # Reward-to-go: G_l = Σ_k γ^k D_{l+k}.
    assert discounted_penalties(penalties, gamma, "to_go") == [0.25 + 0.5 * 0.5 + 0.25 * 1.0, 0.5 + 0.5, 1.0]
    assert discounted_penalties(penalties, 1.0, "own") == penalties
    with pytest.raises(SlimkitError, match="returns 'eq7'"):
        discounted_penalties(penalties, gamma, "eq7")


def test_paper_returns_exclude_the_own_penalty(one_thread):
    # Eq. 7: G_l = Σ_k γ^k D_{l+k+1}; the last layer's G is 0, so one layer gives no signal at all.
    assert discounted_penalties([1.0, 2.0, 3.0], 0.5) == [2.0 + 0.5 * 3.0, 3.0, 0.0]
    assert discounted_penalties([1.0, 2.0, 3.0], 0.5, "to_go") == [1.0 + 0.5 * 2.0 + 0.25 * 3.0, 2.0 + 1.5, 3.0]
    for update in UPDATES:
        _, report = train_policy(_toy_weights(layers=1), 0.5, episodes=3, returns="future", update=update)
        assert report.loss == [0.0, 0.0, 0.0]


class _CountSteps:
    """Counts ``AdamW.step`` calls (and still takes them)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        step = torch.optim.AdamW.step

        def counted(optimizer, *args, **kwargs):
            self.calls += 1
            return step(optimizer, *args, **kwargs)

        monkeypatch.setattr(torch.optim.AdamW, "step", counted)


@pytest.mark.parametrize(("update", "steps"), [("episode", 2), ("layer", 2 * 3)])
def test_update_granularity_counts_optimizer_steps(monkeypatch, update, steps):
    counter = _CountSteps(monkeypatch)
    weights = [torch.randn(12, 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    _, report = train_policy(weights, 0.25, episodes=2, seed=0, returns="own", update=update)
    assert counter.calls == steps and report.optimizer_steps == steps
    assert report.options["update"] == update and report.options["returns"] == "own"


def test_layer_update_scores_each_layer_after_the_previous_step():
    # One layer: the per-layer step is the episode step, so both updates give the same policy.
    weights = [torch.randn(12, 5, generator=torch.Generator().manual_seed(0))]
    a, ra = train_policy(weights, 0.25, episodes=3, seed=4, returns="own", update="episode")
    b, rb = train_policy(weights, 0.25, episodes=3, seed=4, returns="own", update="layer")
    assert ra.layer_penalty == rb.layer_penalty
    torch.testing.assert_close(a.w_inter, b.w_inter)
    torch.testing.assert_close(ra.loss, rb.loss)
    # Two layers: two AdamW steps (one per layer's term) are not one step on their sum.
    two = [*weights, torch.randn(12, 5, generator=torch.Generator().manual_seed(1))]
    c, _ = train_policy(two, 0.25, episodes=1, seed=4, returns="own", update="episode")
    d, _ = train_policy(two, 0.25, episodes=1, seed=4, returns="own", update="layer")
    assert not torch.allclose(c.w_inter, d.w_inter)


def test_log_prob_scores_a_draw_again():
    policy = PruneNetPolicy(20, 6, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(20, 6)
    order, log_prob, eps = policy.sample_with_noise(weight, 7, torch.Generator().manual_seed(1))
    torch.testing.assert_close(policy.log_prob(weight, order, eps), log_prob)
    again, again_log_prob = policy.sample(weight, 7, torch.Generator().manual_seed(1))
    assert torch.equal(again, order) and torch.equal(again_log_prob, log_prob)


def test_training_is_deterministic_for_a_seed(llama):
    weights = ffn_weights(llama)
    p1, r1 = train_policy(weights, 0.25, episodes=3, seed=7)
    p2, r2 = train_policy(weights, 0.25, episodes=3, seed=7)
    _, r3 = train_policy(weights, 0.25, episodes=3, seed=8)
    assert r1.episode_penalty == r2.episode_penalty and r1.loss == r2.loss
    assert torch.equal(p1.w_inter, p2.w_inter) and torch.equal(p1.w_proj, p2.w_proj)
    assert r1.loss != r3.loss
    assert len(r1.episode_penalty) == 3 and all(0.0 <= d <= 1.0 for d in r1.episode_penalty)
    assert r1.kept == [48] * 3 and len(r1.episode_seconds) == 3 and r1.seconds >= sum(r1.episode_seconds)


def test_gram_and_svd_spectra_train_the_same_policy(llama):
    # the penalties read only the order of the singular values, which both methods give alike here: the same
    # penalties every episode, so the same updates and the same trained policy
    weights = ffn_weights(llama)
    p_gram, r_gram = train_policy(weights, 0.25, episodes=3, seed=7, returns="own", update="layer")
    p_svd, r_svd = train_policy(weights, 0.25, episodes=3, seed=7, returns="own", update="layer", spectrum_method="svd")
    assert r_gram.layer_penalty == r_svd.layer_penalty and r_gram.options["spectrum_method"] == "gram"
    assert torch.equal(p_gram.w_inter, p_svd.w_inter) and torch.equal(p_gram.w_proj, p_svd.w_proj)
    with pytest.raises(SlimkitError, match="unknown spectrum method 'qr'"):
        train_policy(weights, 0.25, episodes=1, spectrum_method="qr")  # type: ignore[arg-type]


def test_training_options(llama, opt):
    down = ffn_weights(llama, "down")
    assert down[0].shape == (64, 48)  # FFN2 columns as rows (Table 19)
    _, report = train_policy(down, [0.1, 0.2, 0.3], episodes=2, distance="ad", baseline=True, returns="to_go")
    assert report.kept == [58, 51, 45] and all(d >= 0 for d in report.episode_penalty)
    _, report = train_policy(ffn_weights(opt), 0.5, episodes=2, spectrum_dtype=torch.float64)
    assert len(report.layer_penalty) == 2 and len(report.layer_penalty[0]) == 2
    with pytest.raises(SlimkitError, match="gate"):
        ffn_weights(opt, "gate")


def test_input_errors():
    with pytest.raises(SlimkitError, match="one shape"):
        train_policy([torch.randn(8, 4), torch.randn(8, 5)], 0.2, episodes=1)
    with pytest.raises(SlimkitError, match=r"\[0, 1\)"):
        train_policy([torch.randn(8, 4)], 1.0, episodes=1)
    with pytest.raises(SlimkitError, match="distance"):
        train_policy([torch.randn(8, 4)], 0.2, episodes=1, distance="wasserstein")
    with pytest.raises(SlimkitError, match=f"returns 'reward'; allowed: {', '.join(RETURNS)}"):
        train_policy([torch.randn(8, 4)], 0.2, episodes=1, returns="reward")
    with pytest.raises(SlimkitError, match=f"update 'step'; allowed: {', '.join(UPDATES)}"):
        train_policy([torch.randn(8, 4)], 0.2, episodes=1, update="step")
    policy = PruneNetPolicy(8, 4)
    with pytest.raises(SlimkitError, match="8x4"):
        policy_keep_indices(policy, torch.randn(9, 4), 0.2)
    with pytest.raises(SlimkitError, match="selection"):
        policy_keep_indices(policy, torch.randn(8, 4), 0.2, "greedy")


def _mlp_out(model, x):
    with torch.no_grad():
        return model.model.layers[0].mlp(x)


def test_pruned_mlp_equals_masked_mlp(llama):
    # Kept rows of FFN1 (gate and up) and columns of FFN2 stay aligned: removing the dropped
    # channels gives the dense MLP with those down_proj columns zeroed.
    policy, _ = train_policy(ffn_weights(llama), 0.25, episodes=2, seed=3)
    up = llama.model.layers[0].mlp.up_proj.weight
    keep = policy_keep_indices(policy, up, 0.25, "policy", torch.Generator().manual_seed(0))
    x = torch.randn(2, 5, 48)
    masked = copy.deepcopy(llama)
    dropped = torch.ones(64, dtype=torch.bool)
    dropped[keep] = False
    with torch.no_grad():
        masked.model.layers[0].mlp.down_proj.weight[:, dropped] = 0.0
    expected = _mlp_out(masked, x)
    remove_units(llama, build_groups(llama, "mlp_channel", [0])[0], keep)
    mlp = llama.model.layers[0].mlp
    assert mlp.up_proj.weight.shape == (48, 48) and mlp.down_proj.weight.shape == (48, 48)
    torch.testing.assert_close(_mlp_out(llama, x), expected, rtol=1e-5, atol=1e-6)


def test_save_load_round_trip(tmp_path):
    policy, _ = train_policy([torch.randn(12, 5) for _ in range(2)], 0.25, episodes=2, seed=1)
    policy.selection = "deterministic"
    save_policy(policy, tmp_path / "policy")
    assert sorted(p.name for p in (tmp_path / "policy").iterdir()) == ["policy.json", "policy.safetensors"]
    loaded = load_policy(tmp_path / "policy")
    weight = torch.randn(12, 5)
    assert (loaded.n, loaded.d, loaded.selection) == (12, 5, "deterministic")
    assert torch.equal(loaded(weight), policy(weight))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(
        policy_keep_indices(loaded, weight, 0.5, "policy", g1), policy_keep_indices(policy, weight, 0.5, "policy", g2)
    )
    with pytest.raises(SlimkitError, match="no saved policy"):
        load_policy(tmp_path / "missing")


def test_layer_penalties_compare_selections():
    weights = [torch.randn(32, 8) for _ in range(3)]
    policy = PruneNetPolicy(32, 8)
    for selection in SELECTIONS:
        values = layer_penalties(policy, weights, 0.5, selection, torch.Generator().manual_seed(0))
        assert len(values) == 3 and all(0.0 <= v <= 1.0 for v in values)
    assert layer_penalties(policy, weights, 0.0, "random") == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("average", [0.0, 0.1, 0.2, 0.5, 0.9, 0.95])
@pytest.mark.parametrize("layers", [1, 2, 7, 30])
def test_layer_ratios_mean_and_bounds(average, layers):
    for schedule, spread in (("uniform", None), ("linear", None), ("linear", 0.3), ("linear", -1.2), ("linear", 3.0)):
        ratios = layer_ratios(average, layers, schedule, spread)
        assert len(ratios) == layers
        assert sum(ratios) / layers == pytest.approx(average, abs=1e-9)
        assert all(0.0 <= r <= 0.95 for r in ratios)


def test_linear_ratios_ramp():
    ratios = layer_ratios(0.2, 5, "linear")
    assert ratios == pytest.approx([0.4, 0.3, 0.2, 0.1, 0.0])  # Table 7's [0, 40%] around 20%
    assert layer_ratios(0.2, 5, "linear", spread=-0.2) == pytest.approx([0.1, 0.15, 0.2, 0.25, 0.3])
    with pytest.raises(SlimkitError):
        layer_ratios(0.97, 4)
    with pytest.raises(SlimkitError, match="schedule"):
        layer_ratios(0.2, 4, "cosine")


def test_zero_episodes_keeps_the_initial_policy():
    # episodes=0 is the untrained ablation: the policy is the seeded initialisation, no optimizer step ran
    weights = _toy_weights()
    policy, report = train_policy(weights, 0.25, episodes=0, seed=3)
    n, d = weights[0].shape
    initial = PruneNetPolicy(n, d, generator=torch.Generator().manual_seed(3))
    for trained, start in zip(policy.parameters(), initial.parameters(), strict=True):
        assert torch.equal(trained, start)
    assert report.optimizer_steps == 0 and report.episode_penalty == []
    with pytest.raises(SlimkitError, match="episodes must be at least 0"):
        train_policy(weights, 0.25, episodes=-1)
