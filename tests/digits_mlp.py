"""The tests' own small model and data: scikit-learn's bundled 8x8 digits and an MLP in
float32 or float16. Copies of the demo's (mx_lbsgd_demo.data.load_digits and
mx_lbsgd_demo.models.mlp, same data, split, seeds and layer names), so that the library's
tests import no demo module.

MXNet's CPU wheel has no float16 FullyConnected, so a float16 `Dense` here keeps float16
parameters and float16 activations and casts them to float32 around the matrix product
only. Cast's backward casts the gradients back to float16, so weight and activation
gradients are float16 and underflow exactly as they would on a GPU.
"""
import functools

import mxnet as mx
import numpy as np
from mxnet import gluon

__all__ = ['load_digits', 'mlp']


@functools.lru_cache(maxsize=1)
def _raw_digits():
    from sklearn.datasets import load_digits as _load
    data = _load()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.float32)


def load_digits(seed=0, test_fraction=0.25):
    """(x_train, y_train, x_test, y_test): pixels / 16 as float32, labels as float32.

    The split is a permutation by `seed`; its first `test_fraction` is the test set."""
    x, y = _raw_digits()
    order = np.random.RandomState(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    return x[order[n_test:]], y[order[n_test:]], x[order[:n_test]], y[order[:n_test]]


class _Dense(gluon.HybridBlock):
    def __init__(self, units, in_units, activation=None, dtype='float32', init=None, **kwargs):
        super().__init__(**kwargs)
        self._units = units
        self._activation = activation
        with self.name_scope():
            self.weight = self.params.get('weight', shape=(units, in_units), dtype=dtype,
                                          init=init)
            self.bias = self.params.get('bias', shape=(units,), dtype=dtype, init='zeros')

    def hybrid_forward(self, F, x, weight, bias):
        dtype = 'float32'
        out = F.FullyConnected(F.cast(x, dtype), F.cast(weight, dtype), F.cast(bias, dtype),
                               num_hidden=self._units)
        out = F.cast(out, 'float16') if self.weight.dtype == 'float16' else out
        return F.Activation(out, self._activation) if self._activation else out


def mlp(hidden=(64,), in_units=64, classes=10, dtype='float32', init=None, seed=0):
    """An MLP whose parameters, activations and logits are `dtype`. Its layers are named
    as gluon.nn.Dense's would be (``dense0_weight``, ``dense0_bias``, ``dense1_weight``...)."""
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    sizes = [in_units] + list(hidden)
    with net.name_scope():
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            net.add(_Dense(b, a, 'relu', dtype, init, prefix='dense%d_' % i))
        net.add(_Dense(classes, sizes[-1], None, dtype, init, prefix='dense%d_' % len(hidden)))
    net.initialize(init or mx.init.Xavier(), ctx=mx.cpu())
    return net
