"""McCandlish et al.'s steps/examples trade-off, fitted to the study's steps to target.

"An Empirical Model of Large-Batch Training" (2018), https://arxiv.org/abs/1812.06162,
eq. 2.11: with S the steps and E = S * B the examples a batch size B needs to reach a
target,

    (S / S_min - 1) * (E / E_min - 1) = 1,   which solves to   S(B) = S_min * (1 + B_crit / B)

with B_crit = E_min / S_min. :func:`fit_tradeoff` finds S_min and B_crit by least squares
in log S: for a fixed B_crit the best log S_min is a mean, so only B_crit is searched (a
log-spaced scan, then golden-section refinement). No NumPy-free promise: NumPy only.
"""
import math

import numpy as np

__all__ = ['predicted_steps', 'fit_tradeoff']

#: B_crit is searched within [min(B) / SPAN, max(B) * SPAN]; an optimum at either end
#: means the data do not pin it down (no bend in the curve), and the fit returns None.
SPAN = 100.0


def predicted_steps(batch_sizes, s_min, b_crit):
    """S(B) = S_min * (1 + B_crit / B) for each B."""
    return [s_min * (1.0 + b_crit / b) for b in batch_sizes]


def _best_log_s_min(log_b_crit, batches, log_steps):
    """(residual sum of squares, log S_min) at this B_crit."""
    shape = np.log1p(math.exp(log_b_crit) / batches)
    log_s_min = float(np.mean(log_steps - shape))
    residual = log_steps - shape - log_s_min
    return float(residual @ residual), log_s_min


def fit_tradeoff(batch_sizes, steps):
    """Fit S(B) = S_min (1 + B_crit / B) to the pairs whose steps are not None.

    Returns dict(s_min, e_min, b_crit, rms_log_residual, points) or None when fewer than
    3 batch sizes reached the target or B_crit sits at the edge of the search range."""
    pairs = [(float(b), float(s)) for b, s in zip(batch_sizes, steps)
             if s is not None and s > 0]
    if len(pairs) < 3:
        return None
    batches = np.array([b for b, _ in pairs])
    log_steps = np.log([s for _, s in pairs])
    low, high = math.log(batches.min() / SPAN), math.log(batches.max() * SPAN)
    scan = np.linspace(low, high, 401)
    errors = [_best_log_s_min(x, batches, log_steps)[0] for x in scan]
    i = int(np.argmin(errors))
    if i in (0, len(scan) - 1):
        return None
    a, b = scan[i - 1], scan[i + 1]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    while b - a > 1e-12:
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if _best_log_s_min(c, batches, log_steps)[0] <= _best_log_s_min(d, batches,
                                                                        log_steps)[0]:
            b = d
        else:
            a = c
    log_b_crit = (a + b) / 2.0
    error, log_s_min = _best_log_s_min(log_b_crit, batches, log_steps)
    s_min, b_crit = math.exp(log_s_min), math.exp(log_b_crit)
    return dict(s_min=s_min, e_min=s_min * b_crit, b_crit=b_crit,
                rms_log_residual=math.sqrt(error / len(pairs)), points=len(pairs))
