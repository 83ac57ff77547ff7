"""Fast, correct large-batch and mixed-precision SGD for Apache MXNet 1.9.1.

``import mx_lbsgd`` registers :class:`LBSGD` as ``'lbsgd'`` (replacing MXNet's own), so
``mx.optimizer.create('lbsgd')``, ``gluon.Trainer(params, 'lbsgd')`` and
``Module.fit(optimizer='lbsgd')`` use it, registers :class:`LossScaledSGD` as ``'lssgd'``
and :class:`LAMB` as ``'lblamb'`` (MXNet's ``'lamb'`` stays MXNet's).
"""
import warnings

import mxnet as mx

from . import checkpoint, counting, loss_scale, overflow  # noqa: F401  (old module paths)
from ._native import native_library
from .amp_support import Bfloat16Support, amp_bfloat16_support, amp_bfloat16_trains
from .distributed.sharded import ShardedTrainer
from .gluon import LossScaling, bind, init_kvstore
from .lamb import LAMB
from .lbsgd import LBSGD
from .loss_scaling import (DynamicLossScaler, LossScaleFallingWarning, LossScaleStuckError,
                           OverflowReport, scale_gradient)
from .lssgd import LossScaledSGD
from .noise_scale import GradientNoiseScale
from .lr_scheduler import WarmupScheduler
from .schedules import WARMUP_STRATEGIES, warmup_multiplier

__all__ = ['LBSGD', 'WarmupScheduler', 'WARMUP_STRATEGIES', 'warmup_multiplier',
           'MXNET_LBSGD', 'DynamicLossScaler', 'LossScaleStuckError', 'LossScaling',
           'LossScaledSGD', 'LAMB', 'scale_gradient', 'checkpoint', 'init_kvstore', 'bind',
           'counting', 'native_library', 'GradientNoiseScale', 'OverflowReport',
           'LossScaleFallingWarning', 'ShardedTrainer', 'amp_bfloat16_trains',
           'amp_bfloat16_support', 'Bfloat16Support']
__version__ = '0.1.0'

#: MXNet's own LBSGD class, kept for comparisons after ours takes the 'lbsgd' name.
MXNET_LBSGD = mx.optimizer.optimizer.LBSGD

with warnings.catch_warnings():
    warnings.simplefilter('ignore')   # MXNet warns that 'lbsgd' is being overridden
    mx.optimizer.register(LBSGD)
    mx.optimizer.register(LossScaledSGD)      # as 'losscaledsgd'
mx.optimizer.Optimizer.opt_registry['lssgd'] = LossScaledSGD
mx.optimizer.Optimizer.opt_registry['lblamb'] = LAMB     # register() would take 'lamb'
