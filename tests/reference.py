"""Pure-numpy float64 reference of everything the package computes.

Written from the formulas (MXNet's kernel documentation, the LARS paper, the issue texts),
not from the package's code, so that comparisons against it can fail.
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


def sgd_step(w, g, mom, lr, wd, momentum, rescale, clip):
    """MXNet's sgd_mom_update / sgd_update in float64; returns (w, mom)."""
    g = rescale * g.astype(np.float64)
    if clip is not None and clip > 0:
        g = np.clip(g, -clip, clip)
    step = -lr * (g + wd * w)
    if momentum > 0:
        mom = momentum * mom + step
        return w + mom, mom
    return w + step, mom


class LBSGDReference:
    """LBSGD on float64 copies of the weights (the master weights, for fp16 runs)."""

    def __init__(self, weights, names, lr, wd, momentum=0.0, strategy='linear', B=1,
                 warmup_epochs=5, updates_per_epoch=32, begin_epoch=0, rescale=1.0,
                 clip=None, eta=0.001, eps=0.0, lars_min=0.0, lars_max=math.inf,
                 exclude=('bias', 'gamma', 'beta'), lr_mults=None, wd_mults=None):
        self.w = [np.array(x, dtype=np.float64) for x in weights]
        self.mom = [np.zeros_like(x) for x in self.w]
        self.acc = [np.zeros_like(x) for x in self.w]
        self.names = names
        self.k = 0
        self.__dict__.update(lr=lr, wd=wd, momentum=momentum, strategy=strategy, B=B,
                             W=warmup_epochs * updates_per_epoch,
                             n0=begin_epoch * updates_per_epoch, rescale=rescale, clip=clip,
                             eta=eta, eps=eps, lars_min=lars_min, lars_max=lars_max,
                             exclude=exclude, lr_mults=lr_mults or {}, wd_mults=wd_mults or {})

    def step(self, grads):
        self.k += 1
        for i, g in enumerate(grads):
            self.acc[i] = self.acc[i] + np.asarray(g, dtype=np.float64)
        if self.k % self.B:
            return
        for i, name in enumerate(self.names):
            g = self.acc[i] / self.B
            lr = self.lr * self.lr_mults.get(name, 1.0)
            wd = self.wd * self.wd_mults.get(name, 1.0)
            if self.strategy == 'lars':
                if not name.endswith(self.exclude):
                    lr *= lars_factor(self.w[i], g, wd, self.eta, self.eps, self.rescale,
                                      self.lars_min, self.lars_max)
            else:
                lr *= warmup_multiplier(self.n0 + self.k, self.W, self.B, self.strategy)
            self.w[i], self.mom[i] = sgd_step(self.w[i], g, self.mom[i], lr, wd,
                                              self.momentum, self.rescale, self.clip)
            self.acc[i] = np.zeros_like(self.w[i])
