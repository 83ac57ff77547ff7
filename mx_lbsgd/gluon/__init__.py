"""Gluon integration: bind a Trainer to mx_lbsgd's step protocol, create its kvstore early,
and `LossScaling` (dynamic loss scaling for any Trainer and any optimizer)."""
from __future__ import annotations

import mxnet as mx

from .. import _compat
from ..pipeline import protocol as _protocol
from . import binding as _binding
from .hook import LossScaling

__all__ = ['LossScaling', 'bind', 'init_kvstore']

# an mx_lbsgd optimizer binds the Trainer that steps it (its rescale_grad setter)
_protocol.register_trainer_binder(_binding.bind)

def bind(trainer: mx.gluon.Trainer, window: bool = True) -> mx.gluon.Trainer:
    """Bind `trainer` to mx_lbsgd's step protocol now (an mx_lbsgd optimizer binds its
    Trainer at the first step otherwise); returns `trainer`. window=False: reduce every
    micro-batch (the optimizer then accumulates the reduced gradients) instead of once per
    update, as the `LossScaling` hook does.

    Parameters
    ----------
    trainer : gluon.Trainer
    window : bool, default True
        Whether the Trainer keeps an accumulation window (``batch_scale > 1``) at its
        reduction, reducing once per update.

    Returns
    -------
    gluon.Trainer
        `trainer` itself.

    Examples
    --------
    >>> import mxnet as mx
    >>> from mxnet import gluon
    >>> import mx_lbsgd
    >>> net = gluon.nn.Dense(1, in_units=2)
    >>> net.initialize()
    >>> trainer = gluon.Trainer(net.collect_params(), 'lbsgd', {'batch_scale': 2})
    >>> mx_lbsgd.bind(trainer) is trainer
    True
    """
    _binding.bind(trainer, window)
    return trainer


def init_kvstore(trainer: mx.gluon.Trainer, batch_size: int) -> None:
    """Create the Trainer's kvstore and broadcast the initial weights now, waiting for it.

    MXNet 1.9.1's Trainer does this lazily inside the first `step`, where the pull of the
    initial weights and the first push of gradients use different arrays and are not
    ordered: on a dist kvstore a worker can receive the first gradient sum as its weights
    (seen here: 1 run in 12 under load). Call this once after creating the Trainer (the
    parameters must be initialized), before the first `step`, with the `batch_size` you
    will pass to `step` (servers that update get the optimizer, rescale_grad included, now).

    Parameters
    ----------
    trainer : gluon.Trainer
        Its parameters initialized.
    batch_size : int
        The batch size `trainer.step` will get.

    Examples
    --------
    >>> import mxnet as mx
    >>> from mxnet import gluon
    >>> import mx_lbsgd
    >>> net = gluon.nn.Dense(1, in_units=2)
    >>> net.initialize()
    >>> trainer = gluon.Trainer(net.collect_params(), 'lbsgd', {'learning_rate': 0.1},
    ...                         kvstore='local')
    >>> mx_lbsgd.init_kvstore(trainer, batch_size=4)
    >>> trainer.optimizer.rescale_grad
    0.25
    """
    _binding.bind(trainer)
    trainer.optimizer.rescale_grad = _compat.trainer_scale(trainer) / batch_size
    _compat.init_trainer_params(trainer)
    mx.nd.waitall()
