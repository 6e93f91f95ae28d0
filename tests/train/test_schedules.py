"""Every schedule equation against hand-computed values."""

from __future__ import annotations

import math

import pytest

from exitlm.config import ConfigError
from exitlm.train.schedules import (
    WeightSchedule,
    curriculum_mask,
    dropout_rates,
    layer_scale,
    layerskip_scale,
    normalized_scales,
    time_scale,
)


def test_weight_schedule_constant_warmup_cooldown() -> None:
    assert WeightSchedule("constant", target=0.3)(1000) == pytest.approx(0.3)
    w = WeightSchedule("warmup", target=1.0, initial=0.2, steps=4)
    assert [w(t) for t in (0, 1, 2, 4, 9)] == pytest.approx([0.2, 0.4, 0.6, 1.0, 1.0])
    c = WeightSchedule("cooldown", target=0.0, initial=0.8, steps=4, style="cosine")
    # (1 - cos(pi s)) / 2 at s = 0, 1/4, 1/2, 1
    frac = [0.0, (1 - math.cos(math.pi / 4)) / 2, 0.5, 1.0]
    assert [c(t) for t in (0, 1, 2, 4)] == pytest.approx([0.8 - 0.8 * f for f in frac])


def test_weight_schedule_errors() -> None:
    with pytest.raises(ConfigError, match="weight_steps"):
        WeightSchedule("warmup", steps=0)
    with pytest.raises(ConfigError, match="warm-up goes up"):
        WeightSchedule("warmup", target=0.1, initial=0.5, steps=3)
    with pytest.raises(ConfigError, match="cool-down goes down"):
        WeightSchedule("cooldown", target=0.5, initial=0.1, steps=3)
    with pytest.raises(ConfigError, match="linear or cosine"):
        WeightSchedule("warmup", steps=3, style="exp")  # type: ignore[arg-type]


def test_layerskip_scale_e() -> None:
    # L = 4, e_scale = 0.5: e(0)=0, e(1)=0.5*1, e(2)=0.5*3, e(3)=3 + 0.5*(0+1+2)=4.5
    assert [layerskip_scale(l, 4, 0.5) for l in range(4)] == pytest.approx([0, 0.5, 1.5, 4.5])
    assert [layerskip_scale(l, 4, 0.0) for l in range(4)] == pytest.approx([0, 0, 0, 3])
    with pytest.raises(ConfigError, match="e_scale"):
        layerskip_scale(1, 4, 1.5)


def test_normalized_scales_eq6() -> None:
    s = normalized_scales([1, 2, 3, 4], 4, 0.5, [True, True, True, True])
    assert s == pytest.approx({1: 0.0, 2: 0.5 / 6.5, 3: 1.5 / 6.5, 4: 4.5 / 6.5})
    s = normalized_scales([1, 2, 3, 4], 4, 0.5, [False, True, False, True])
    assert s == pytest.approx({2: 0.5 / 5.0, 4: 4.5 / 5.0})
    assert sum(s.values()) == pytest.approx(1.0)


def test_rotational_curriculum() -> None:
    # 5 candidates (4 early + final), R = 2: even positions at t=0, odd at t=1; final always
    assert curriculum_mask("rotational", 0, 5, rotation=2) == [True, False, True, False, True]
    assert curriculum_mask("rotational", 1, 5, rotation=2) == [False, True, False, True, True]
    assert curriculum_mask("rotational", 2, 5, rotation=2) == [True, False, True, False, True]
    # each early exit enabled exactly once every R iterations
    r = 3
    for j in range(4):
        assert sum(curriculum_mask("rotational", t, 5, rotation=r)[j] for t in range(r)) == 1


def test_gradual_curriculum() -> None:
    # L = 4 candidates, T = 16: one more exit every T / 2L = 2 steps, from the last down
    masks = [curriculum_mask("gradual", t, 4, total_steps=16) for t in range(10)]
    assert masks[0] == masks[1] == [False, False, False, True]
    assert masks[2] == masks[3] == [False, False, True, True]
    assert masks[4] == [False, True, True, True]
    assert masks[6] == masks[9] == [True, True, True, True]  # all on by T/2 = 8


def test_dropout_rates_eq2_to_4() -> None:
    # D(l) = 2^(l/(L-1)) - 1
    assert [layer_scale(l, 3) for l in range(3)] == pytest.approx([0, math.sqrt(2) - 1, 1])
    assert time_scale(5, 11, "none") == 1.0
    assert time_scale(0, 11, "exp") == 0.0
    assert time_scale(10, 11, "exp") == pytest.approx(1.0)
    assert time_scale(5, 11, "exp") == pytest.approx(math.sqrt(2) - 1)
    p = dropout_rates(3, 0.2, 5, 11, "exp")
    s = math.sqrt(2) - 1
    assert p == pytest.approx([0.0, s * s * 0.2, s * 0.2])
    assert dropout_rates(3, 0.2, 5, 11, "none") == pytest.approx([0, s * 0.2, 0.2])
    with pytest.raises(ConfigError, match="p_max"):
        dropout_rates(3, 1.5, 0, 10)
