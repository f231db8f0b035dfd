"""llama.cpp's --kl-divergence statistics (kvq_lab.tasks.kld_stats) against direct computations on fixed arrays."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvq_lab.tasks.kld_stats import covariance, mean_and_uncertainty, percentile, report

RNG = np.random.default_rng(7)
N = 41
NLL = RNG.gamma(2.0, 1.2, N)
NLL_BASE = NLL * 0.9 + RNG.normal(0, 0.1, N)
KLD = RNG.exponential(0.05, N)
SAME = RNG.random(N) < 0.8


def test_mean_and_uncertainty_is_the_standard_error_with_n_minus_1():
    m, u = mean_and_uncertainty(NLL)
    assert m == pytest.approx(NLL.mean())
    assert u == pytest.approx(NLL.std(ddof=0) / math.sqrt(N - 1))  # population variance over N - 1, as llama.cpp
    assert mean_and_uncertainty(NLL[:10])[1] == 0.0  # llama.cpp reports no uncertainty for N <= 10


def test_covariance_of_the_means():
    want = np.mean((NLL - NLL.mean()) * (NLL_BASE - NLL_BASE.mean())) / (N - 1)
    assert covariance(NLL, NLL_BASE) == pytest.approx(want)


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.05, 0.1, 0.9, 0.95, 0.99, 0.999, 0.37])
def test_percentiles_interpolate_linearly_between_sorted_values(fraction):
    s = np.sort(KLD)
    assert percentile(s, fraction) == pytest.approx(np.percentile(KLD, 100 * fraction, method="linear"))


def test_median_ends_and_a_hand_case():
    assert percentile(np.array([1.0, 2.0, 10.0, 20.0]), 0.5) == 6.0  # even count: the middle two's mean
    assert percentile(np.array([1.0, 2.0, 10.0]), 0.5) == 2.0
    assert percentile(np.array([0.0, 10.0]), 0.25) == 2.5  # 0.25 * (2 - 1) between 0 and 10
    s = np.array([3.0, 5.0])
    assert percentile(s, 0.0) == 3.0 and percentile(s, 1.0) == 5.0


def test_report_matches_direct_computations():
    r = report(NLL, NLL_BASE, KLD, SAME)
    sq, sb = NLL.std() / math.sqrt(N - 1), NLL_BASE.std() / math.sqrt(N - 1)
    cov = np.mean((NLL - NLL.mean()) * (NLL_BASE - NLL_BASE.mean())) / (N - 1)
    assert r["ppl"] == pytest.approx(math.exp(NLL.mean())) and r["ppl_unc"] == pytest.approx(r["ppl"] * sq)
    assert r["ref_ppl"] == pytest.approx(math.exp(NLL_BASE.mean()))
    assert r["ln_ppl_ratio"] == pytest.approx(NLL.mean() - NLL_BASE.mean())
    assert r["ln_ppl_ratio_unc"] == pytest.approx(math.sqrt(sq**2 + sb**2 - 2 * cov))
    assert r["ln_ppl_cor"] == pytest.approx(np.corrcoef(NLL, NLL_BASE)[0, 1])  # cov / (se_q se_base)
    assert r["ppl_ratio"] == pytest.approx(r["ppl"] / r["ref_ppl"])
    assert r["kl_mean"] == pytest.approx(KLD.mean()) and r["kl_max"] == KLD.max() and r["kl_min"] == KLD.min()
    assert r["kl_median"] == pytest.approx(np.median(KLD))
    assert r["kl_p99"] == pytest.approx(np.percentile(KLD, 99))
    dp = np.exp(-NLL) - np.exp(-NLL_BASE)
    assert r["dp_mean"] == pytest.approx(dp.mean()) and r["dp_p25"] == pytest.approx(np.percentile(dp, 25))
    assert r["dp_rms"] == pytest.approx(math.sqrt(np.mean(dp**2)))
    f = SAME.mean()
    assert r["top1_agree"] == pytest.approx(f) and r["top1_agree_unc"] == pytest.approx(
        math.sqrt(f * (1 - f) / (N - 1))
    )


def test_identical_distributions_report_no_difference():
    r = report(NLL, NLL, np.zeros(N), np.ones(N, bool))
    assert r["ln_ppl_ratio"] == 0 and r["ln_ppl_ratio_unc"] == pytest.approx(0, abs=1e-9)
    assert r["kl_mean"] == 0 and r["dp_rms"] == 0 and r["top1_agree"] == 1 and r["top1_agree_unc"] == 0


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="equal lengths"):
        report(NLL, NLL_BASE[:-1], KLD, SAME)
