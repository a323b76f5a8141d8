"""critical/joint.py: when the joint fit of B_crit(L) is flagged (lack of fit, a falling or undetermined sign)."""

from __future__ import annotations

import numpy as np
import pytest

from globalbatch.critical.joint import fit_joint, joint_flags, outside_band

BATCHES = [206.0, 412.0, 824.0, 1647.0]
TARGETS = [1.3564, 1.3160, 1.2757, 1.2353, 1.1950]


def _rows(b_crit_at, seed_sd=0.03, seeds=(0, 1), s_min=40.0):
    """(target, seed, batch, steps) with S = S_min·(1 + B_crit(L)/B) and a seed's steps moved by ``seed_sd``."""
    rng = np.random.default_rng(7)
    return [(t, s, b, s_min * (1 + b_crit_at(t) / b) * float(np.exp(rng.normal(0, seed_sd))))
            for s in seeds for t in TARGETS for b in BATCHES]


def test_u_shaped_b_crit_is_flagged_as_lack_of_fit_and_undetermined_sign():
    """The medians of a U-shaped B_crit(L) (a tester's sweep: 1,240 / 994 / 761 / 661 / 1,153) are no power law:
    the band misses most of them and the exponent's sign is not determined."""
    u = dict(zip(TARGETS, [1240.0, 994.0, 761.0, 661.0, 1153.0]))
    fit = fit_joint(_rows(u.get))
    flags = joint_flags(fit, list(u.items()))
    assert any(f.startswith("lack of fit: the joint fit's 95% band excludes the median over seeds at ") for f in flags)
    assert any(f.startswith("sign undetermined: exponent k = ") for f in flags), (fit.k, fit.se_k)
    assert sum(outside_band(m, fit.interval(t)) for t, m in u.items()) >= 2


def test_b_crit_falling_with_the_loss_is_flagged_and_a_good_power_law_is_not():
    falls = lambda t: 800.0 * (t / 1.27) ** 6.0  # noqa: E731  (k = +6: falls as the loss falls)
    fit = fit_joint(_rows(falls))
    assert fit.k > 2 * fit.se_k
    flags = joint_flags(fit, [(t, falls(t)) for t in TARGETS])
    assert [f.split(":")[0] for f in flags] == ["B_crit falls as the loss falls"]
    rises = lambda t: 800.0 * (t / 1.27) ** -6.0  # noqa: E731  (McCandlish/Kaplan's direction)
    fit = fit_joint(_rows(rises))
    assert fit.k < -2 * fit.se_k and joint_flags(fit, [(t, rises(t)) for t in TARGETS]) == []


def test_one_miss_in_five_is_within_a_5_percent_miss_rate():
    """The rule: flagged when P(≥ misses of n | 5 % per target) < 5 %: 1 of 5 is not flagged, 2 of 5 is."""
    rises = lambda t: 800.0 * (t / 1.27) ** -6.0  # noqa: E731
    fit = fit_joint(_rows(rises))
    med = [(t, rises(t)) for t in TARGETS]
    one = [(t, m * (3.0 if i == 0 else 1.0)) for i, (t, m) in enumerate(med)]
    two = [(t, m * (3.0 if i < 2 else 1.0)) for i, (t, m) in enumerate(med)]
    assert joint_flags(fit, one) == []
    assert [f.split(":")[0] for f in joint_flags(fit, two)] == ["lack of fit"]
    assert joint_flags(fit, [(t, None) for t in TARGETS]) == []  # no medians: nothing to compare
    with pytest.raises(ValueError):
        fit_joint(_rows(rises)[:3])
