"""A Python SGD of our own (numpy float64 math), as an MXNet Optimizer, for
mx.test_utils.compare_optimizer: MXNet's SGD semantics on dense values.

    g = clip(rescale_grad * grad, clip_gradient) (no clip when clip_gradient is falsy)
    mom = momentum * mom - lr * (g + wd * w);  w += mom         (momentum > 0)
    w = w - lr * (g + wd * w)                                   (momentum = 0)

With multi_precision and float16 weights the math runs on an fp32 master copy, state
(mom fp32 or None, master fp32), and the weight is the master cast to float16.
"""
import numpy as np
import mxnet as mx


class NumpySGD(mx.optimizer.Optimizer):
    def __init__(self, momentum=0.0, multi_precision=False, lazy_rows=False, **kwargs):
        super().__init__(multi_precision=multi_precision, **kwargs)
        self.momentum = momentum
        self.lazy_rows = lazy_rows     # only rows whose gradient is not all zero change

    def create_state_multi_precision(self, index, weight):
        if self.multi_precision and weight.dtype == np.float16:
            master = mx.nd.array(weight.asnumpy().astype(np.float32), dtype=np.float32)
            mom = mx.nd.zeros(weight.shape, dtype=np.float32) if self.momentum else None
            return (mom, master)
        return mx.nd.zeros(weight.shape, dtype=weight.dtype) if self.momentum else None

    def update_multi_precision(self, index, weight, grad, state):
        lr, wd = self._get_lr(index), self._get_wd(index)
        self._update_count(index)
        mp = isinstance(state, tuple)
        mom = state[0] if mp else state
        target = state[1] if mp else weight
        w = target.asnumpy().astype(np.float64)
        g = grad.asnumpy().astype(np.float64) * self.rescale_grad
        if self.clip_gradient:
            g = np.clip(g, -self.clip_gradient, self.clip_gradient)
        keep = np.ones(w.shape[0], dtype=bool)
        if self.lazy_rows:
            keep = np.any(grad.asnumpy().reshape(w.shape[0], -1) != 0, axis=1)
        step = -lr * (g + wd * w)
        if self.momentum:
            m0 = mom.asnumpy().astype(np.float64)
            m = np.where(keep.reshape((-1,) + (1,) * (w.ndim - 1)), self.momentum * m0 + step,
                         m0)
            mom[:] = m.astype(mom.dtype)
            w = np.where(keep.reshape((-1,) + (1,) * (w.ndim - 1)), w + m, w)
        else:
            w = np.where(keep.reshape((-1,) + (1,) * (w.ndim - 1)), w + step, w)
        target[:] = w.astype(target.dtype)
        if mp:
            weight[:] = target.asnumpy().astype(weight.dtype)

    update = update_multi_precision


def lazy_sgd_rows(w, mom, g, rows, lr, wd, momentum, rescale=1.0):
    """Lazy SGD on float64 numpy arrays: only `rows` change (weight, momentum, decay)."""
    w, mom = w.copy(), mom.copy()
    for r in rows:
        step = -lr * (rescale * g[r] + wd * w[r])
        if momentum:
            mom[r] = momentum * mom[r] + step
            w[r] = w[r] + mom[r]
        else:
            w[r] = w[r] + step
    return w, mom
