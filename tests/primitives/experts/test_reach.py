"""Whole experts against a target, by hand (:func:`slimkit.primitives.experts.reach.expert_reach`): 2 layers of 6
experts of 100 parameters each, top-2 (each layer may lose 4)."""

from __future__ import annotations

import pytest

from slimkit.primitives.experts.reach import expert_reach

REMOVABLE = [4, 4]


def test_uniform_removes_a_count_per_layer_rounded():
    # 25% of 1200 = 300 parameters: 1.5 experts per layer rounds to 2 (400), the counts nearest are 1 and 2
    reach = expert_reach(300, 100, REMOVABLE, uniform=True, slack=6)
    assert (reach.count, reach.step, reach.removed, reach.most) == (2, 200, 400, 4)
    assert not reach.lands and not reach.too_many and reach.nearest() == (200, 400)


def test_global_removes_a_total_and_lands_within_half_an_expert():
    reach = expert_reach(300, 100, REMOVABLE, uniform=False, slack=6)
    assert (reach.count, reach.removed, reach.most) == (3, 300, 8) and reach.lands
    assert expert_reach(350, 100, REMOVABLE, uniform=False, slack=6).lands is False  # 3.5 -> 4 experts: 400
    assert expert_reach(350, 100, REMOVABLE, uniform=False, slack=50).lands is True


@pytest.mark.parametrize(("uniform", "wanted"), [(True, 1000), (False, 900)])
def test_more_than_the_layers_can_lose(uniform, wanted):
    reach = expert_reach(wanted, 100, REMOVABLE, uniform=uniform, slack=0)
    assert reach.too_many and not reach.lands
    assert reach.nearest()[-1] == reach.most * reach.step  # the nearest possible count is the most there is


def test_a_target_on_a_multiple_lands_exactly():
    assert expert_reach(400, 100, REMOVABLE, uniform=True, slack=0).lands
    assert expert_reach(0, 100, REMOVABLE, uniform=True, slack=0).lands  # nothing left to remove
