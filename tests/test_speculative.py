"""k3lab.speculative: the committed-tokens formula, its two simulators, cycle costs and the best depth."""

import itertools
import math

import numpy as np
import pytest

from k3lab import speculative as spec
from k3lab.speculative import simulate
from k3lab.config import K3Config

# --------------------------------------------------------------------------------------------
# The formula
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("acceptance, depth, expected", [
    ([0.5], 1, 1.5),                   # one draft: the draft half the time, plus the target's token
    ([0.5, 0.5], 2, 1.75),             # 1 + 0.5 + 0.25
    ([0.8, 0.5, 0.25], 3, 2.3),        # 1 + 0.8 + 0.4 + 0.1
    ([0.8, 0.5, 0.25], 2, 2.2),        # only the first two positions count
    ([1.0, 0.0, 1.0], 3, 2.0),         # a certain rejection at position 2 ends every cycle there
    ([0.0, 1.0], 2, 1.0),              # nothing accepted: only the recovery token
    ([1.0, 1.0, 1.0, 1.0], 4, 5.0),    # everything accepted: four drafts plus the bonus token
])
def test_expected_committed_hand_computed(acceptance, depth, expected):
    assert spec.expected_committed(acceptance, depth) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("rate", [0.05, 0.3, 0.5, 0.77, 0.9, 0.999])
@pytest.mark.parametrize("depth", [1, 2, 3, 5, 8, 13])
def test_constant_acceptance_matches_closed_form(rate, depth):
    closed = (1 - rate ** (depth + 1)) / (1 - rate)  # geometric series 1 + a + ... + a^k
    assert spec.expected_committed(spec.constant_acceptance(rate, depth),
                                   depth) == pytest.approx(closed, rel=1e-12)


def test_expected_committed_all_agrees_with_each_depth():
    rng = np.random.default_rng(3)
    a = rng.uniform(0.2, 1.0, size=9)
    all_depths = spec.expected_committed_all(a)
    assert all_depths.shape == (9,)
    for k in range(1, 10):
        assert all_depths[k - 1] == pytest.approx(spec.expected_committed(a, k), rel=1e-14)
    assert np.all(np.diff(all_depths) >= 0)  # a deeper draft never commits fewer tokens per cycle


def test_committed_distribution_is_a_distribution_with_the_formula_as_mean():
    a = [0.9, 0.7, 0.6, 0.3]
    for k in range(1, 5):
        dist = spec.committed_distribution(a, k)
        assert dist.shape == (k + 1,)
        assert dist.sum() == pytest.approx(1.0, abs=1e-14)
        assert dist @ np.arange(1, k + 2) == pytest.approx(spec.expected_committed(a, k), rel=1e-14)
    # by hand for k = 2: commit 1 (reject first) 0.1, commit 2 (accept, reject) 0.9 * 0.3, commit 3: 0.63
    assert spec.committed_distribution(a, 2) == pytest.approx([0.1, 0.27, 0.63], abs=1e-14)


def test_reference_curve_reproduces_the_seed():
    a = spec.reference_acceptance(8)
    assert round(spec.expected_committed(a, 3), 2) == 3.00
    assert round(spec.expected_committed(a, 4), 2) == 3.36
    # the 12% break-even of the seed: committed(4) / committed(3) - 1
    assert round(float(spec.break_even_growth(a)[2]), 2) == 0.12
    assert np.all((a > 0) & (a < 1)) and np.all(np.diff(a) < 0)


def test_geometric_fit_recovers_known_parameters():
    first, decay = 0.92, 0.88
    curve = spec.geometric_acceptance(first, decay, 6)
    targets = {2: spec.expected_committed(curve, 2), 6: spec.expected_committed(curve, 6)}
    got_first, got_decay = spec.fit_geometric_acceptance(targets)
    assert got_first == pytest.approx(first, abs=1e-9)
    assert got_decay == pytest.approx(decay, abs=1e-9)


def test_geometric_fit_refuses_unreachable_targets():
    with pytest.raises(ValueError, match="targets"):
        spec.fit_geometric_acceptance({3: 3.0, 4: 4.5})  # one more draft adds at most one token
    with pytest.raises(ValueError, match="targets"):
        spec.fit_geometric_acceptance({3: 3.0})


# --------------------------------------------------------------------------------------------
# Cycle-level simulator
# --------------------------------------------------------------------------------------------


def test_simulator_agrees_with_formula_on_random_curves():
    rng = np.random.default_rng(2024)
    for _ in range(20):
        depth = int(rng.integers(1, 9))
        a = rng.uniform(0.0, 1.0, size=depth)
        sim = spec.simulate_cycles(a, depth, cycles=200_000, seed=int(rng.integers(1 << 31)))
        z = sim.z_score(spec.expected_committed(a, depth))
        assert abs(z) < 3, (a, depth, sim, z)
        # the whole histogram, not only its mean
        _, _, pval = spec.chi_square(sim.counts, spec.committed_distribution(a, depth))
        assert pval > 1e-3, (a, depth, sim.counts)


def test_simulator_detects_a_wrong_curve():
    # The agreement test can fail: a curve off by 0.01 per position is > 3 standard errors away.
    a = spec.reference_acceptance(4)
    sim = spec.simulate_cycles(a, 4, cycles=500_000, seed=5)
    assert abs(sim.z_score(spec.expected_committed(a - 0.01, 4))) > 3


def test_loop_and_vectorised_simulators_count_the_same_cycles():
    a = spec.reference_acceptance(5)
    fast = spec.simulate_cycles(a, 5, cycles=50_000, seed=11, chunk=4096)
    slow = spec.simulate_cycles_loop(a, 5, cycles=50_000, seed=11, chunk=4096)
    np.testing.assert_array_equal(fast.counts, slow.counts)
    assert fast.cycles == 50_000 and fast.counts.sum() == 50_000


def test_simulator_edge_curves_are_exact():
    assert spec.simulate_cycles([1.0, 1.0, 1.0], 3, cycles=1000).mean == 4.0
    zero = spec.simulate_cycles([0.0, 0.5], 2, cycles=1000)
    assert zero.mean == 1.0 and zero.stderr == 0.0


# --------------------------------------------------------------------------------------------
# Token-level rejection sampling
# --------------------------------------------------------------------------------------------


def _markov_logits(vocab=8, spread=0.8, seed=7):
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(vocab, vocab))
    draft = target + spread * rng.normal(size=(vocab, vocab))
    return target, draft


def test_committed_tokens_follow_the_target_distribution():
    target, draft = _markov_logits()
    stats = spec.simulate_tokens(target, draft, depth=4, cycles=200_000, seed=1)
    stat, dof, pval = stats.chi_square()
    assert dof == 8 * 7
    assert pval > 1e-3, (stat, dof, pval)
    # and the mean committed tokens match the exact curve derived from the two distributions
    assert abs(stats.z_score(stats.expected)) < 3
    assert stats.transitions.sum() == round(stats.mean * stats.cycles)


def test_resampling_from_the_target_on_rejection_is_biased():
    # The negative control: resampling a rejected position from p (not from max(0, p - q)) puts
    # too much weight on the tokens the drafter already favours; the chi-square sees it.
    target, draft = _markov_logits()
    stats = spec.simulate_tokens(target, draft, depth=4, cycles=200_000, seed=1, recovery="target")
    assert stats.chi_square()[2] < 1e-6


def test_draft_tokens_alone_do_not_follow_the_target():
    # Without verification the committed tokens would follow q, which the chi-square rejects.
    target, draft = _markov_logits()
    q = np.exp(draft) / np.exp(draft).sum(axis=1, keepdims=True)
    rng = np.random.default_rng(0)
    counts = np.stack([rng.multinomial(20_000, row) for row in q])
    assert spec.chi_square(counts, simulate._softmax_rows("target", target))[2] < 1e-6


def test_context_free_acceptance_is_one_minus_total_variation():
    rng = np.random.default_rng(4)
    target, draft = rng.normal(size=6), rng.normal(size=6)
    p = np.exp(target) / np.exp(target).sum()
    q = np.exp(draft) / np.exp(draft).sum()
    curve = spec.acceptance_from_distributions(target, draft, depth=5)
    np.testing.assert_allclose(curve, np.minimum(p, q).sum(), rtol=1e-12)
    stats = spec.simulate_tokens(target, draft, depth=5, cycles=100_000, seed=2)
    closed = (1 - curve[0] ** 6) / (1 - curve[0])
    assert stats.expected == pytest.approx(closed, rel=1e-12)
    assert abs(stats.z_score(closed)) < 3
    assert stats.chi_square()[2] > 1e-3


def test_markov_acceptance_curve_by_enumeration():
    # P(first j drafts accepted) summed over every draft sequence, with min(1, p/q) written out.
    target, draft = _markov_logits(vocab=3, spread=1.5, seed=9)
    p = simulate._softmax_rows("target", target)
    q = simulate._softmax_rows("draft", draft)
    context = np.array([0.2, 0.5, 0.3])
    survival = [1.0]
    for j in range(1, 4):
        total = 0.0
        for start in range(3):
            for seq in itertools.product(range(3), repeat=j):
                prob, prev = context[start], start
                for x in seq:
                    prob *= q[prev, x] * min(1.0, p[prev, x] / q[prev, x])
                    prev = x
                total += prob
        survival.append(total)
    want = np.array(survival[1:]) / np.array(survival[:-1])
    got = spec.acceptance_from_distributions(target, draft, depth=3, context=context)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert not np.allclose(got, got[0])  # with context, acceptance varies along the draft


def test_chi_square_known_value():
    stat, dof, pval = spec.chi_square([10, 20, 30], [1 / 3, 1 / 3, 1 / 3])
    assert stat == pytest.approx(10.0)
    assert dof == 2
    assert pval == pytest.approx(math.exp(-5.0), rel=1e-10)  # two degrees of freedom: exp(-stat / 2)
    assert spec.chi_square([[3, 1]], [[1.0, 0.0]])[2] == 0.0  # an impossible token was seen


# --------------------------------------------------------------------------------------------
# Costs and the best depth
# --------------------------------------------------------------------------------------------


def test_cycle_costs_add_up():
    costs = spec.CycleCosts(draft_step_us=50, verify_us=(1000, 1100, 1250, 1400), commit_us=30,
                            draft_fixed_us=20)
    assert costs.max_depth == 3
    assert costs.cycle_us(1) == 20 + 50 + 1100 + 30
    assert costs.cycle_us(3) == 20 + 150 + 1400 + 30
    np.testing.assert_array_equal(costs.cycle_all(), [1200, 1400, 1600])
    assert costs.plain_decode_us() == 1000
    lin = spec.linear_costs(draft_step_us=10, verify_one_us=100, verify_extra_position_us=5, max_depth=4)
    assert lin.verify_us == (100, 105, 110, 115, 120)
    assert "user-given" in lin.source
    assert "illustrative" in spec.illustrative_costs().source


def test_best_depth_on_hand_computed_rates():
    a = spec.constant_acceptance(0.8, 4)     # committed: 1.8, 2.44, 2.952, 3.3616
    cycle = [100.0, 120.0, 150.0, 160.0]     # rates: 18000, 20333, 19680, 21010 per second
    choice = spec.best_depth(a, cycle)
    assert choice.depth == 4
    assert choice.tokens_per_s == pytest.approx(3.3616 / 160e-6)
    t = choice.table
    assert list(t["depth"]) == [1, 2, 3, 4]
    assert t["break_even_growth"].iloc[0] == pytest.approx(2.44 / 1.8 - 1)
    assert t["cycle_growth"].iloc[1] == pytest.approx(0.25)
    assert list(t["deeper_pays"]) == [True, False, True, False]
    assert spec.best_depth(a, cycle, max_depth=3).depth == 2


def test_the_seeds_break_even():
    # With the reference curve, 4 drafts beat 3 exactly when the cycle grows by less than 12%.
    a = spec.reference_acceptance(4)
    gain = spec.expected_committed(a, 4) / spec.expected_committed(a, 3) - 1
    assert spec.best_depth(a[:4], [1e9, 1e9, 1000.0, 1000.0 * (1 + gain) * 0.99]).depth == 4
    assert spec.best_depth(a[:4], [1e9, 1e9, 1000.0, 1000.0 * (1 + gain) * 1.01]).depth == 3


def test_illustrative_profiles_choose_different_depths():
    a = spec.reference_acceptance(8)
    depths = {name: spec.best_depth(a, spec.illustrative_costs(name)).depth for name
              in spec.ILLUSTRATIVE_PROFILES}
    assert len(set(depths.values())) == len(depths), depths
    table = spec.best_depth(a, spec.illustrative_costs()).table
    assert (table["speedup_vs_plain"] > 1).all()


def _record(study, shape, us, device="NVIDIA H200", mode="graph", variant="after"):
    from k3lab import bench

    return bench.Record(study=study, case=f"c{shape}".replace(" ", "").replace("'", "")
                        .replace(":", "").replace(",", "_").replace("{", "").replace("}", ""),
                        variant=variant, device=device, backend="cuda", versions={}, commit="test",
                        date="2026-12-01", shape=shape, dtype="bfloat16", median_us=us, p20_us=us,
                        p80_us=us, mode=mode)


def test_costs_from_records(tmp_path):
    from k3lab import bench

    kda = {1: 8.0, 2: 9.0, 4: 11.0, 8: 15.0}
    mla = {1: 20.0, 2: 21.0, 3: 22.0, 4: 23.0, 5: 24.0}
    recs = [_record("kda_verify", {"B": 1, "T": t, "H": 12}, us) for t, us in kda.items()]
    # graph preferred
    recs += [_record("kda_verify", {"B": 1, "T": t, "H": 12}, 99.0, mode="eager") for t in kda]
    recs += [_record("kda_verify", {"B": 32, "T": t, "H": 12}, 50.0) for t in kda]  # another batch
    recs += [_record("mla_padding", {"B": 1, "q_len": n, "heads": 16}, us) for n, us in mla.items()]
    bench.save_records(recs, root=tmp_path)
    costs = spec.costs_from_records(draft_step_us=100, commit_us=10, rest_one_us=1000,
                                    rest_extra_position_us=20, root=tmp_path)
    assert costs.max_depth == 4  # MLA stops at 5 positions: nothing past it is invented
    want3 = 69 * 10.0 + 24 * 22.0 + 1000 + 2 * 20  # KDA at 3 positions interpolated between 2 and 4
    assert costs.verify(3) == pytest.approx(want3)
    assert costs.verify(1) == pytest.approx(69 * 8 + 24 * 20 + 1000)
    assert "NVIDIA H200" in costs.source and "user-given" in costs.source
    assert spec.best_depth(spec.reference_acceptance(4), costs).depth >= 1


def test_costs_from_records_says_when_there_are_none(tmp_path):
    with pytest.raises(spec.NoVerifyRecords, match="none"):
        spec.costs_from_records(draft_step_us=100, root=tmp_path)
    from k3lab import bench

    bench.save_records([_record("kda_verify", {"B": 1, "T": 4}, 6.0)], root=tmp_path)
    with pytest.raises(spec.NoVerifyRecords, match=r"'kda': \[4\], 'mla': \[\]"):  # one count, no MLA
        spec.costs_from_records(draft_step_us=100, root=tmp_path)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call, name", [
    (lambda: spec.expected_committed([0.5, 1.2], 2), "acceptance"),
    (lambda: spec.expected_committed([0.5, -0.1], 1), "acceptance"),
    (lambda: spec.expected_committed([0.5, float("nan")], 1), "acceptance"),
    (lambda: spec.expected_committed([], 1), "acceptance"),
    (lambda: spec.expected_committed([[0.5]], 1), "acceptance"),
    (lambda: spec.expected_committed([0.5, 0.5], 0), "depth"),
    (lambda: spec.expected_committed([0.5, 0.5], 3), "depth"),
    (lambda: spec.expected_committed([0.5, 0.5], 1.5), "depth"),
    (lambda: spec.expected_committed_all([0.5, float("inf")]), "acceptance"),
    (lambda: spec.committed_distribution([0.5], 2), "depth"),
    (lambda: spec.constant_acceptance(1.5, 3), "rate"),
    (lambda: spec.geometric_acceptance(0.9, float("nan"), 3), "decay"),
    (lambda: spec.simulate_cycles([0.5], 1, cycles=0), "cycles"),
    (lambda: spec.simulate_cycles([0.5, 2.0], 1), "acceptance"),
    (lambda: spec.simulate_cycles([0.5], 2), "depth"),
    (lambda: spec.simulate_tokens(np.zeros(4), np.zeros(5), 2), "draft_logits"),
    (lambda: spec.simulate_tokens(np.zeros(4), np.zeros(4), 2, recovery="p"), "recovery"),
    (lambda: spec.simulate_tokens([0.0, float("nan")], [0.0, 0.0], 2), "target_logits"),
    (lambda: spec.simulate_tokens(np.zeros(4), np.zeros(4), 0), "depth"),
    (lambda: spec.CycleCosts(draft_step_us=-1, verify_us=(1, 2)), "draft_step_us"),
    (lambda: spec.CycleCosts(draft_step_us=1, verify_us=(1, -2)), "verify_us"),
    (lambda: spec.CycleCosts(draft_step_us=1, verify_us=(1, 2), commit_us=float("nan")), "commit_us"),
    (lambda: spec.CycleCosts(draft_step_us=1, verify_us=(1,)), "verify_us"),
    (lambda: spec.linear_costs(draft_step_us=1, verify_one_us=-5, verify_extra_position_us=1),
     "verify_one_us"),
    (lambda: spec.best_depth([0.5, 0.5], [100.0, -1.0]), "costs"),
    (lambda: spec.best_depth([0.5, 1.5], [100.0, 110.0]), "acceptance"),
    (lambda: spec.best_depth([0.5, 0.5], [100.0, 110.0], max_depth=3), "max_depth"),
    (lambda: spec.illustrative_costs("fast"), "name"),
    (lambda: spec.costs_from_records(draft_step_us=-3), "draft_step_us"),
])
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_costs_from_records_never_mixes_context_lengths(tmp_path):
    from k3lab import bench

    recs = [_record("kda_verify", {"B": 1, "T": t}, 5.0 + t) for t in (1, 2, 3)]
    for L, base in ((1024, 10.0), (32768, 40.0)):
        recs += [_record("mla_padding", {"B": 1, "q_len": n, "L": L}, base + n) for n in (1, 2, 3)]
    bench.save_records(recs, root=tmp_path)
    with pytest.raises(spec.NoVerifyRecords, match="'L'"):
        spec.costs_from_records(draft_step_us=100, root=tmp_path)
    costs = spec.costs_from_records(draft_step_us=100, root=tmp_path, where={"mla": {"L": 32768}})
    assert costs.verify(2) == pytest.approx(69 * 7.0 + 24 * 42.0)
    assert "32768" in costs.source
    with pytest.raises(ValueError, match="where"):
        spec.costs_from_records(draft_step_us=100, root=tmp_path, where={"moe": {}})


def test_the_committed_h200_records_give_a_measured_verify_profile():
    """The committed H200 records cover 1 to 8 positions in both studies (KDA at 1, 2, 4 and 8; MLA at
    every count, at one context length), so the measured profile reaches depth 7: the cycle costs are
    built from them, layer for layer."""
    where = {"mla": {"context": 32768}}
    entry = spec.verify_records_summary(device="nvidia-h200", where=where)["nvidia-h200"]
    costs = spec.costs_from_records(draft_step_us=1000, device="nvidia-h200", where=where)
    assert (
        "NVIDIA H200" in costs.source
        and costs.max_depth == min(max(entry["kda"]), max(entry["mla"])) - 1 == 7
    )
    assert sorted(entry["mla"]) == list(range(1, 9))
    layers = K3Config.full()
    assert costs.verify(1) == pytest.approx(layers.num_kda_layers * entry["kda"][1]
                                            + layers.num_mla_layers * entry["mla"][1])
