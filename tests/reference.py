"""Pure-numpy float64 reference of everything the package computes: the one reference
every comparison uses.

Written from the formulas (MXNet's kernel documentation, the LARS paper, the issue texts),
not from the package's code, so that comparisons against it can fail. `NumpySGD` adapts
`sgd_step` to MXNet's Optimizer interface for ``mx.test_utils.compare_optimizer``.
"""
import math

import numpy as np


def warmup_multiplier(n, W, B, mode):
    if n >= W:
        return float(B)
    r = n / W
    shape = {'linear': r, 'power2': r ** 2, 'sqrt': math.sqrt(r)}[mode]
    return 1.0 + (B - 1.0) * shape


def warmup_lr(t, base_lr, W, mode, begin_lr=0.0, decay=None, max_update=None,
              final_lr=0.0, power=2.0):
    if t < W:
        r = t / W
        shape = {'linear': r, 'power2': r ** 2, 'sqrt': math.sqrt(r)}[mode]
        return begin_lr + (base_lr - begin_lr) * shape
    if decay is None:
        return base_lr
    if t >= max_update:
        return final_lr
    p = (t - W) / (max_update - W)
    keep = (1 - p) ** power if decay == 'poly' else (1 + math.cos(math.pi * p)) / 2
    return final_lr + (base_lr - final_lr) * keep


def lars_factor(w, g, wd, eta, eps, rescale, lo=0.0, hi=math.inf):
    wn = np.sqrt(np.sum(np.square(w, dtype=np.float64)))
    gn = np.sqrt(np.sum(np.square(g, dtype=np.float64))) * rescale
    if wn == 0 or gn == 0:
        return 1.0
    return float(min(max(eta * wn / (gn + wd * wn + eps), lo), hi))


def sgd_step(w, g, mom, lr, wd, momentum, rescale, clip, rows=None, nesterov=False):
    """MXNet's sgd_mom_update / sgd_update in float64; returns (w, mom). With `rows`
    (lazy update of a row_sparse gradient) only those rows change::

        g = clip(rescale * g, clip)              # no clip when clip is None or <= 0
        mom = momentum * mom - lr * (g + wd * w);  w = w + mom      (momentum > 0)
        w = w - lr * (g + wd * w)                                   (momentum = 0)

    With `nesterov` and momentum, MXNet NAG's rule as MXNet 1.9.1's own test of
    ``mx.optimizer.NAG`` (tests/python/unittest/test_optimizer.py, PyNAG) states it: the
    weight first, then the momentum, whose decay term sees the new weight::

        w = w + momentum ** 2 * mom - lr * (momentum + 1) * (g + wd * w)
        mom = momentum * mom - lr * (g + wd * w)
    """
    g = rescale * np.asarray(g, dtype=np.float64)
    if clip is not None and clip > 0:
        g = np.clip(g, -clip, clip)
    if nesterov and momentum > 0:
        new_w = w + momentum ** 2 * mom - lr * (momentum + 1) * (g + wd * w)
        new_mom = momentum * mom - lr * (g + wd * new_w)
        assert rows is None, 'NAG has no lazy update'
        return new_w, new_mom
    step = -lr * (g + wd * w)
    new_mom = momentum * mom + step if momentum > 0 else mom
    new_w = w + new_mom if momentum > 0 else w + step
    if rows is None:
        return new_w, new_mom
    keep = np.zeros(w.shape[0], dtype=bool)
    keep[list(rows)] = True
    keep = keep.reshape((-1,) + (1,) * (w.ndim - 1))
    return np.where(keep, new_w, w), (np.where(keep, new_mom, mom) if momentum > 0 else mom)


def clip_coefficient(grads, rescale, max_grad_norm, eps=1e-6):
    """Global-norm clipping in float64: min(1, max_grad_norm / (|rescale * grads| + eps)),
    the norm over every array of `grads`; 1 when max_grad_norm is None or 0."""
    if not max_grad_norm:
        return 1.0
    norm = math.sqrt(sum(float(np.sum(np.square(rescale * np.asarray(g, dtype=np.float64))))
                         for g in grads))
    return min(1.0, max_grad_norm / (norm + eps))


class LBSGDReference:
    """LBSGD on float64 copies of the weights (the master weights, for fp16 runs)."""

    def __init__(self, weights, names, lr, wd, momentum=0.0, strategy='linear', B=1,
                 warmup_epochs=5, updates_per_epoch=32, begin_epoch=0, rescale=1.0,
                 clip=None, eta=0.001, eps=0.0, lars_min=0.0, lars_max=math.inf,
                 exclude=('bias', 'gamma', 'beta'), lr_mults=None, wd_mults=None, lars=None,
                 max_grad_norm=None, nesterov=False):
        self.w = [np.array(x, dtype=np.float64) for x in weights]
        self.mom = [np.zeros_like(x) for x in self.w]
        self.acc = [np.zeros_like(x) for x in self.w]
        self.names = names
        self.k = 0
        self.__dict__.update(lr=lr, wd=wd, momentum=momentum, strategy=strategy, B=B,
                             W=warmup_epochs * updates_per_epoch,
                             n0=begin_epoch * updates_per_epoch, rescale=rescale, clip=clip,
                             eta=eta, eps=eps, lars_min=lars_min, lars_max=lars_max,
                             exclude=exclude, lr_mults=lr_mults or {}, wd_mults=wd_mults or {},
                             lars=strategy == 'lars' if lars is None else lars,
                             max_grad_norm=max_grad_norm, nesterov=nesterov)
        self.coefficients = []     # the clip coefficient of each update

    def step(self, grads):
        self.k += 1
        for i, g in enumerate(grads):
            self.acc[i] = self.acc[i] + np.asarray(g, dtype=np.float64)
        if self.k % self.B:
            return
        c = clip_coefficient([a / self.B for a in self.acc], self.rescale, self.max_grad_norm)
        self.coefficients.append(c)
        for i, name in enumerate(self.names):
            g = c * self.acc[i] / self.B
            lr = self.lr * self.lr_mults.get(name, 1.0)
            wd = self.wd * self.wd_mults.get(name, 1.0)
            if self.strategy != 'lars':
                lr *= warmup_multiplier(self.n0 + self.k, self.W, self.B, self.strategy)
            if self.lars and not name.endswith(self.exclude):
                lr *= lars_factor(self.w[i], g, wd, self.eta, self.eps, self.rescale,
                                  self.lars_min, self.lars_max)
            self.w[i], self.mom[i] = sgd_step(self.w[i], g, self.mom[i], lr, wd,
                                              self.momentum, self.rescale, self.clip,
                                              nesterov=self.nesterov)
            self.acc[i] = np.zeros_like(self.w[i])


def lazy_sgd_rows(w, mom, g, rows, lr, wd, momentum, rescale=1.0):
    """Lazy SGD on float64 numpy arrays: only `rows` change (weight, momentum, decay)."""
    return sgd_step(w, g, mom, lr, wd, momentum, rescale, None, rows=rows)


def _numpy_sgd():
    import mxnet as mx

    class NumpySGD(mx.optimizer.Optimizer):
        """`sgd_step` as an MXNet Optimizer (MXNet's SGD, or with nesterov NAG, semantics on
        dense values). With
        multi_precision and float16 weights the math runs on an fp32 master copy (state
        (mom or None, master)) and the weight is the master cast to float16. lazy_rows:
        only rows whose gradient is not all zero change."""

        def __init__(self, momentum=0.0, multi_precision=False, lazy_rows=False,
                     nesterov=False, **kwargs):
            super().__init__(multi_precision=multi_precision, **kwargs)
            self.momentum = momentum
            self.lazy_rows = lazy_rows
            self.nesterov = nesterov

        def create_state_multi_precision(self, index, weight):
            mom_dtype = np.float32 if self.multi_precision else weight.dtype
            mom = mx.nd.zeros(weight.shape, dtype=mom_dtype) if self.momentum else None
            if self.multi_precision and weight.dtype == np.float16:
                return (mom, mx.nd.array(weight.asnumpy().astype(np.float32),
                                         dtype=np.float32))
            return mom

        def update_multi_precision(self, index, weight, grad, state):
            lr, wd = self._get_lr(index), self._get_wd(index)
            self._update_count(index)
            mp = isinstance(state, tuple)
            mom = state[0] if mp else state
            target = state[1] if mp else weight
            w = target.asnumpy().astype(np.float64)
            g = grad.asnumpy()
            rows = (np.flatnonzero(np.any(g.reshape(w.shape[0], -1) != 0, axis=1))
                    if self.lazy_rows else None)
            m0 = mom.asnumpy().astype(np.float64) if self.momentum else None
            w, m = sgd_step(w, g, m0, lr, wd, self.momentum, self.rescale_grad,
                            self.clip_gradient, rows=rows, nesterov=self.nesterov)
            if self.momentum:
                mom[:] = m.astype(mom.dtype)
            target[:] = w.astype(target.dtype)
            if mp:
                weight[:] = target.asnumpy().astype(weight.dtype)

        update = update_multi_precision

    return NumpySGD


def NumpySGD(**kwargs):    # noqa: N802  (a class, built when first used: it needs mxnet)
    return _numpy_sgd()(**kwargs)


def lamb_step(w, g, mean, var, t, lr, wd, beta1=0.9, beta2=0.999, epsilon=1e-6,
              lower_bound=None, upper_bound=None, bias_correction=True, rescale=1.0,
              clip=None, ratio=True):
    """One LAMB update in float64 (You et al. 2019, MXNet's lamb_update_phase1/phase2
    documentation); returns (w, mean, var)::

        g = clip(rescale * g, clip)
        mean = beta1 * mean + (1 - beta1) * g;  var = beta2 * var + (1 - beta2) * g ** 2
        m, v = mean / (1 - beta1 ** t), var / (1 - beta2 ** t)    (if bias_correction)
        d = m / (sqrt(v) + epsilon) + wd * w
        r1 = |w| clipped to [lower_bound, upper_bound] (a bound counts when set and > 0)
        w = w - lr * (r1 / |d| if ratio and r1 > 0 and |d| > 0 else 1) * d
    """
    g = rescale * np.asarray(g, dtype=np.float64)
    if clip is not None and clip > 0:
        g = np.clip(g, -clip, clip)
    mean = beta1 * mean + (1 - beta1) * g
    var = beta2 * var + (1 - beta2) * g * g
    m, v = mean, var
    if bias_correction:
        m, v = mean / (1 - beta1 ** t), var / (1 - beta2 ** t)
    d = m / (np.sqrt(v) + epsilon) + wd * w
    r1 = float(np.sqrt(np.sum(w * w)))
    if lower_bound is not None and lower_bound > 0:
        r1 = max(r1, lower_bound)
    if upper_bound is not None and upper_bound > 0:
        r1 = min(r1, upper_bound)
    r2 = float(np.sqrt(np.sum(d * d)))
    trust = r1 / r2 if ratio and r1 > 0 and r2 > 0 else 1.0
    return w - lr * trust * d, mean, var
