"""What one training run of the digits demo depends on: :class:`TrainConfig`, the
defaults of ``mx-lbsgd train``, and the checks that refuse a configuration.

Conventions: ``batch_size`` is the micro-batch of one forward/backward pass (per worker
with a dist kvstore); ``lbsgd`` and ``mxnet-lbsgd`` sum ``batch_scale`` micro-batches per
update, so an update sees ``batch_size * batch_scale`` samples and the warmup takes the
learning rate from ``lr`` to ``lr * batch_scale``.
"""
import dataclasses
from typing import Optional, Tuple, Union

from .data import DATASETS

__all__ = ['OPTIMIZERS', 'WARMUP_OPTIMIZERS', 'ACCUMULATING_OPTIMIZERS', 'DEFAULT_LR', 'DEFAULT_LARS_LR', 'DEMO_DEFAULTS',
           'LR_SCALING_RULES', 'LR_SCALING_OPTIMIZERS', 'AUTO_OPTIMIZERS', 'AUTO_BOUNDS',
           'ConfigError', 'TrainConfig', 'check', 'baseline_config', 'longest_window']

OPTIMIZERS = ('lbsgd', 'lssgd', 'sgd', 'mxnet-lbsgd', 'lars', 'lblamb')
WARMUP_OPTIMIZERS = ('lbsgd', 'mxnet-lbsgd')     # the ones with warmup and batch_scale
ACCUMULATING_OPTIMIZERS = WARMUP_OPTIMIZERS + ('lblamb',)     # the ones with batch_scale
LR_SCALING_RULES = ('linear', 'sqrt', 'adascale')
LR_SCALING_OPTIMIZERS = ('lbsgd', 'lssgd', 'lblamb')   # the ones with lr_scaling
AUTO_OPTIMIZERS = ('lbsgd', 'lblamb')                   # the ones with batch_scale='auto'
#: batch_scale_bounds of batch_scale='auto' when none are given
AUTO_BOUNDS = (1, 16)
#: Learning rate used when none is given (measured on digits, batch 32, momentum 0.9).
DEFAULT_LR = {'lbsgd': 0.05, 'lssgd': 0.05, 'sgd': 0.05, 'mxnet-lbsgd': 0.05, 'lars': 2.0,
              'lblamb': 0.01}
DEFAULT_LARS_LR = 2.0       # lbsgd with warmup_strategy='lars' (trust ratio eta = 0.001)
#: What ``mx-lbsgd train`` changes in TrainConfig's defaults (the defaults of ``--single``)
#: for its main run: an effective batch of 32 x 8 = 256 by accumulation, linear warmup
#: over 5 epochs, float16 weights with fp32 master copies and dynamic loss scaling.
#: batch_scale and warmup_epochs apply to lbsgd / mxnet-lbsgd only.
DEMO_DEFAULTS = dict(batch_scale=8, epochs=30, warmup_epochs=5.0, dtype='float16',
                     growth_interval=20)


class ConfigError(ValueError):
    """A configuration the optimizers or the trainer refuse (one-line message)."""


@dataclasses.dataclass
class TrainConfig:
    """Everything one run depends on (see the module docstring for the conventions)."""
    optimizer: str = 'lbsgd'
    warmup_strategy: str = 'linear'
    warmup_epochs: float = 1.0
    batch_size: int = 32
    batch_scale: Union[int, str] = 1           # or 'auto' (lr_scaling needed)
    epochs: int = 15
    lr: Optional[float] = None                 # None: DEFAULT_LR / DEFAULT_LARS_LR
    momentum: float = 0.9
    wd: float = 1e-4
    dtype: str = 'float32'
    loss_scale: Union[str, float, None] = None  # None: 'dynamic' for float16, else 'none'
    growth_interval: int = 100
    kvstore: Optional[str] = None
    seed: int = 0
    hidden: Tuple[int, ...] = (64, 64)
    target: float = 0.95
    test_fraction: float = 0.25
    record_steps: bool = True                  # steps history (one host read per step)
    dataset: str = 'digits'                    # or 'digits-shifted' (see data.load_data)
    val_fraction: float = 0.0                  # of the non-test images: validation split
    lr_decay: Optional[str] = None             # None or 'cosine' (to 0 at the last step)
    warmup_from: Optional[float] = None        # sgd/lssgd/lars: linear warmup from this lr
    hybridize: bool = True                     # Gluon hybridize(static_alloc=True)
    max_grad_norm: Optional[float] = None      # global-norm clipping of the applied gradient
    lr_scaling: Optional[str] = None           # None or one of LR_SCALING_RULES
    batch_scale_bounds: Optional[Tuple[int, int]] = None   # 'auto': None is AUTO_BOUNDS

    def resolved_lr(self):
        if self.lr is not None:
            return float(self.lr)
        if self.optimizer == 'lbsgd' and self.warmup_strategy == 'lars':
            return DEFAULT_LARS_LR
        return DEFAULT_LR[self.optimizer]

    def resolved_loss_scale(self):
        """'none', 'dynamic' or a float."""
        if self.loss_scale is None:
            return 'dynamic' if self.dtype == 'float16' else 'none'
        return self.loss_scale


def check(cfg):
    """ConfigError if `cfg` is refused before anything is built."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ConfigError('optimizer=%r is not supported; expected one of %r'
                          % (cfg.optimizer, OPTIMIZERS))
    if cfg.dtype not in ('float32', 'float16'):
        raise ConfigError("dtype=%r is not supported; expected 'float32' or 'float16'"
                          % (cfg.dtype,))
    if cfg.dataset not in DATASETS:
        raise ConfigError('dataset=%r is not supported; expected one of %r'
                          % (cfg.dataset, DATASETS))
    if cfg.batch_scale != 1 and cfg.optimizer not in ACCUMULATING_OPTIMIZERS:
        raise ConfigError('batch_scale=%s needs optimizer lbsgd, mxnet-lbsgd or lblamb (got %s)'
                          % (cfg.batch_scale, cfg.optimizer))
    if cfg.lr_scaling not in (None,) + LR_SCALING_RULES:
        raise ConfigError('lr_scaling=%r is not supported; expected one of %r'
                          % (cfg.lr_scaling, (None,) + LR_SCALING_RULES))
    if cfg.lr_scaling is not None and cfg.optimizer not in LR_SCALING_OPTIMIZERS:
        raise ConfigError('lr_scaling needs optimizer lbsgd, lssgd or lblamb (got %s)'
                          % cfg.optimizer)
    if cfg.batch_scale == 'auto':
        if cfg.optimizer not in AUTO_OPTIMIZERS:
            raise ConfigError("batch_scale='auto' needs optimizer lbsgd or lblamb (got %s)"
                              % cfg.optimizer)
        if cfg.lr_scaling is None:
            raise ConfigError("batch_scale='auto' needs an lr_scaling rule (%s)"
                              % ', '.join(LR_SCALING_RULES))
    elif cfg.batch_scale_bounds is not None:
        raise ConfigError("batch_scale_bounds needs batch_scale='auto' (got batch_scale=%s)"
                          % cfg.batch_scale)
    if cfg.warmup_from is not None and cfg.optimizer in WARMUP_OPTIMIZERS:
        raise ConfigError('warmup_from is for optimizers without a warmup of their own, '
                          'not %s' % cfg.optimizer)
    if cfg.max_grad_norm is not None and not (0 < cfg.max_grad_norm < float('inf')):
        raise ConfigError('max_grad_norm=%r is not supported; expected None or a finite '
                          'number > 0' % (cfg.max_grad_norm,))
    if cfg.lr_decay not in (None, 'cosine'):
        raise ConfigError("lr_decay=%r is not supported; expected None or 'cosine'"
                          % (cfg.lr_decay,))


def baseline_config(cfg):
    """The baseline of the default run: `cfg`'s data, model, epochs and seed, trained the
    plain way: mx SGD with momentum, one micro-batch per update (cfg.batch_size), float32,
    no loss scaling, no warmup, the default lr."""
    return dataclasses.replace(
        cfg, optimizer='sgd', warmup_strategy='linear', batch_scale=1, lr=None,
        dtype='float32', loss_scale=None, kvstore=None, warmup_from=None, lr_decay=None,
        max_grad_norm=None, lr_scaling=None, batch_scale_bounds=None)


def longest_window(cfg):
    """The longest window of `cfg`: batch_scale, or hi of 'auto''s bounds."""
    if cfg.batch_scale != 'auto':
        return cfg.batch_scale
    return (cfg.batch_scale_bounds or AUTO_BOUNDS)[1]
