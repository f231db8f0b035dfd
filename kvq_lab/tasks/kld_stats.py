"""The statistics `llama-perplexity --kl-divergence` reports, with llama.cpp's definitions (tools/perplexity,
`kl_divergence`), from per-token arrays: so that a kvq_lab fidelity record and a llama.cpp log can be read side by
side.

Per scored token t: nll_t = -ln p_Q(x_t), nll_base_t = -ln p_base(x_t), kld_t = KL(base || Q) over the vocabulary,
dp_t = p_Q(x_t) - p_base(x_t), same_t = [argmax p_Q == argmax p_base]. Then, over the N tokens:

- mean and uncertainty of x: mean(x) and sqrt((mean(x^2) - mean(x)^2) / (N - 1)) (0 when N <= 10);
- PPL(Q) = exp(mean nll) with uncertainty PPL * unc(nll); PPL(base) alike;
- cov = (mean(nll * nll_base) - mean(nll) mean(nll_base)) / (N - 1); Cor = cov / (unc(nll) unc(nll_base));
- ln(PPL(Q)/PPL(base)) = mean nll - mean nll_base, uncertainty sqrt(unc(nll)^2 + unc(nll_base)^2 - 2 cov);
  PPL(Q)/PPL(base) = exp of it, uncertainty ratio * that; PPL(Q) - PPL(base) with
  sqrt(unc_Q^2 + unc_base^2 - 2 PPL_Q PPL_base cov);
- KLD: mean with uncertainty, percentiles by linear interpolation between sorted values at fraction * (N - 1)
  (max, 99.9, 99, 95, 90, median, 10, 5, 1, 0.1, min; the median of an even count is the mean of the middle two);
- dp: mean with uncertainty, the same percentiles plus 75 and 25; RMS dp = sqrt(mean dp^2), uncertainty
  unc(dp^2) / (2 RMS);
- same top p: the fraction, binomial uncertainty sqrt(f (1 - f) / (N - 1)).

llama.cpp computes its base distribution from a file of log-probabilities stored as 16-bit integers (about 2.4e-4
nats apart) and leaves out of the KL sum the tokens whose base log-probability is at most -16; kvq_lab keeps the
reference exact. Pure functions over numpy arrays; `fidelity` (kvq_lab/tasks/fidelity.py) reports them.
"""

from __future__ import annotations

import math

import numpy as np

KLD_PERCENTILES = (("max", 1.0), ("p99_9", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.90), ("median", 0.5),
                   ("p10", 0.10), ("p5", 0.05), ("p1", 0.01), ("p0_1", 0.001), ("min", 0.0))  # fmt: skip
DP_PERCENTILES = (("max", 1.0), ("p99_9", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.90), ("p75", 0.75),
                  ("median", 0.5), ("p25", 0.25), ("p10", 0.10), ("p5", 0.05), ("p1", 0.01), ("p0_1", 0.001),
                  ("min", 0.0))  # fmt: skip


def mean_and_uncertainty(x: np.ndarray) -> tuple[float, float]:
    """(mean, standard error) as llama.cpp computes them: sqrt((E[x^2] - E[x]^2) / (N - 1)); 0 for N <= 10."""
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if n < 1:
        return 0.0, 0.0
    f = float(x.mean())
    var = float((x * x).mean()) - f * f
    return f, (math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


def covariance(a: np.ndarray, b: np.ndarray) -> float:
    """llama.cpp's covariance of the two means: (E[ab] - E[a] E[b]) / (N - 1); 0 for N < 10."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = a.size
    if n < 10:
        return 0.0
    return (float((a * b).mean()) - float(a.mean()) * float(b.mean())) / (n - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """Linear interpolation between sorted values at fraction * (N - 1); the ends for fractions <= 0 and >= 1;
    fraction 0.5 gives llama.cpp's median (the mean of the middle two for an even count)."""
    v = sorted_values
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    if fraction == 0.5:
        n = v.size
        return float(0.5 * (v[n // 2] + v[n // 2 - 1])) if n % 2 == 0 else float(v[n // 2])
    p = fraction * (v.size - 1)
    i = int(p)
    p -= i
    return float((1 - p) * v[i] + p * v[min(i + 1, v.size - 1)])


def report(nll: np.ndarray, nll_base: np.ndarray, kld: np.ndarray, same_top: np.ndarray) -> dict[str, float]:
    """The `--kl-divergence` statistics (module docstring) -> flat dict: ppl, ppl_unc, ref_ppl, ref_ppl_unc,
    ln_ppl_cor, ln_ppl_ratio(_unc), ppl_ratio(_unc), ppl_diff(_unc), kl_mean(_unc), kl_<percentile>, dp_mean(_unc),
    dp_<percentile>, dp_rms(_unc), top1_agree(_unc). Probabilities as fractions (llama.cpp prints dp in %)."""
    nll, nll_base = np.asarray(nll, np.float64).ravel(), np.asarray(nll_base, np.float64).ravel()
    kld, same = np.asarray(kld, np.float64).ravel(), np.asarray(same_top, bool).ravel()
    n = nll.size
    if not n == nll_base.size == kld.size == same.size or n < 2:
        raise ValueError(
            f"need >= 2 tokens and equal lengths, got {nll.size}, {nll_base.size}, {kld.size}, {same.size}"
        )
    out: dict[str, float] = {}
    lq, uq = mean_and_uncertainty(nll)
    lb, ub = mean_and_uncertainty(nll_base)
    cov = covariance(nll, nll_base)
    ppl, ref = math.exp(lq), math.exp(lb)
    out.update(ppl=ppl, ppl_unc=ppl * uq, ref_ppl=ref, ref_ppl_unc=ref * ub)
    out["ln_ppl_cor"] = cov / (uq * ub) if uq > 0 and ub > 0 else float("nan")
    ratio_unc = math.sqrt(max(uq * uq + ub * ub - 2 * cov, 0.0))
    out.update(ln_ppl_ratio=lq - lb, ln_ppl_ratio_unc=ratio_unc)
    out.update(ppl_ratio=math.exp(lq - lb), ppl_ratio_unc=math.exp(lq - lb) * ratio_unc)
    diff_unc = math.sqrt(max((ppl * uq) ** 2 + (ref * ub) ** 2 - 2 * ppl * ref * cov, 0.0))
    out.update(ppl_diff=ppl - ref, ppl_diff_unc=diff_unc)
    out["kl_mean"], out["kl_mean_unc"] = mean_and_uncertainty(kld)
    s = np.sort(kld)
    out.update({f"kl_{name}": percentile(s, f) for name, f in KLD_PERCENTILES})
    dp = np.exp(-nll) - np.exp(-nll_base)
    out["dp_mean"], out["dp_mean_unc"] = mean_and_uncertainty(dp)
    s = np.sort(dp)
    out.update({f"dp_{name}": percentile(s, f) for name, f in DP_PERCENTILES})
    mse, mse_unc = mean_and_uncertainty(dp * dp)
    rms = math.sqrt(mse)
    out.update(dp_rms=rms, dp_rms_unc=(0.5 / rms * mse_unc) if rms > 0 else 0.0)
    f = float(same.mean())
    out.update(top1_agree=f, top1_agree_unc=math.sqrt(f * (1 - f) / (n - 1)))
    return out
