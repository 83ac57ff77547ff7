"""The dynamic loss-scale policy: pure Python, no mxnet import.

One rule covers PyTorch's GradScaler, Keras' LossScaleOptimizer, nnabla's
DynamicLossScalingUpdater, MindSpore's DynamicLossScaleUpdateCell, TF/Ascend's
ExponentialUpdateLossScaleManager and DeepSpeed/Megatron (hysteresis, min scale)::

    if not enabled: never skip, scale 1
    if found_overflow:                         # the step is skipped
        good = 0; bad += 1; skipped += 1
        if dynamic and bad >= hysteresis:
            scale = max(scale * backoff_factor, min_scale); good = bad = 0
    else:
        good += 1
        if consecutive_hysteresis: bad = 0
        if dynamic and good >= growth_interval:
            if scale * growth_factor is finite: scale = min(scale * growth_factor, max_scale)
            good = bad = 0

An early warning, before `min_scale` is reached (the seeds have none: PyTorch, Keras and
MindSpore back off silently, apex and DeepSpeed log every overflow, DeepSpeed and fairseq
raise once the minimum is reached)::

    falling = backoffs since the last growth >= warn_backoffs
              or (>= 2 of them and the next backoff reaches min_scale)
    chronic = the last warn_window steps seen and skipped / warn_window >= warn_skip_fraction
    either one, once per descent (re-armed by a growth) or crossing: an alert that
    `take_alert()` hands over (the optimizers and `LossScaling` warn with the parameters that
    overflowed most; a bare scaler only keeps it)
"""
from __future__ import annotations

import collections
import logging
import math
import warnings
from typing import Any, Deque, Mapping

from .._checks import check_choice, check_int, check_real

_log = logging.getLogger('mx_lbsgd')


class LossScaleStuckError(FloatingPointError):
    """Raised when every step overflows at `min_scale` for `stuck_patience` steps.

    Only with ``DynamicLossScaler(on_stuck='raise')`` (the default, 'warn', warns once).
    A `FloatingPointError`.

    Examples
    --------
    >>> import mx_lbsgd
    >>> scaler = mx_lbsgd.DynamicLossScaler(init_scale=1.0, stuck_patience=2,
    ...                                     on_stuck='raise')
    >>> scaler.update(found_overflow=True)
    False
    >>> scaler.update(found_overflow=True)
    Traceback (most recent call last):
    ...
    mx_lbsgd.loss_scaling.scaler.LossScaleStuckError: loss scale stuck at 1: 2 consecutive ...
    """


class DynamicLossScaler:
    """Loss scale with growth, backoff, hysteresis, bounds and a policy for a stuck scale.

    Parameters
    ----------
    init_scale : float > 0, default 2**16
    growth_factor : float > 1, default 2
    backoff_factor : float in (0, 1), default 0.5
    growth_interval : int >= 1, default 2000
        Consecutive finite steps before the scale grows.
    hysteresis : int >= 1, default 1
        Overflow steps, accumulated since the last scale change, before the scale backs off.
    consecutive_hysteresis : bool, default False
        Count only consecutive overflow steps (a finite step resets the count).
    min_scale, max_scale : float, default 1 and 2**24
    dynamic : bool, default True
        False keeps the scale fixed (overflow steps are still skipped).
    enabled : bool, default True
        False: scale 1, no step is ever skipped.
    stuck_patience : int >= 1, default 100
        Consecutive overflow steps at `min_scale` before `on_stuck` acts.
    on_stuck : {'warn', 'raise', 'ignore'}, default 'warn'
    warn_backoffs : int >= 1 or None, default 8
        Early warning after this many backoffs without a growth (None: off). 8 is half the
        halvings from PyTorch's and DeepSpeed's initial 2**16 down to DeepSpeed's (and this
        class's) min_scale 1; an initial calibration rarely takes more than a few.
    warn_skip_fraction : float in (0, 1] or None, default 0.05
        Early warning when this fraction of the last `warn_window` steps was skipped (None:
        off). A healthy run with growth_interval=2000 skips about 1 step in 2000.
    warn_window : int >= 1, default 1000
        Steps the skipped fraction is taken over (DeepSpeed's loss_scale_window).

    Raises
    ------
    ValueError
        An argument out of its range (``growth_factor <= 1``, ``backoff_factor`` outside
        (0, 1), ``min_scale > max_scale``, ``init_scale`` outside [min_scale, max_scale],
        an unknown ``on_stuck``, ...).
    TypeError
        A number of the wrong type (``growth_interval=2.5``).

    Examples
    --------
    Back off on an overflow, grow after `growth_interval` finite steps:

    >>> import mx_lbsgd
    >>> scaler = mx_lbsgd.DynamicLossScaler(init_scale=1024, growth_interval=2)
    >>> scaler.update(found_overflow=True)       # skip this step
    False
    >>> scaler.scale
    512.0
    >>> [scaler.update(found_overflow=False) for _ in range(2)]
    [True, True]
    >>> scaler
    DynamicLossScaler(scale=1024, good=0, bad=0, skipped=1/3)

    Its state resumes in another scaler:

    >>> resumed = mx_lbsgd.DynamicLossScaler()
    >>> resumed.load_state_dict(scaler.state_dict())
    >>> resumed.scale, resumed.growth_interval, resumed.total_skipped
    (1024.0, 2, 1)
    """

    _STATE = ('scale', 'num_good_steps', 'num_bad_steps', 'total_skipped', 'total_steps',
              'stuck_steps')

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, hysteresis: int = 1,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0,
                 max_scale: float = 2.0 ** 24, dynamic: bool = True, enabled: bool = True,
                 stuck_patience: int = 100, on_stuck: str = 'warn',
                 warn_backoffs: int | None = 8, warn_skip_fraction: float | None = 0.05,
                 warn_window: int = 1000) -> None:
        check_real('init_scale', init_scale, 0.0, math.inf, open_min=True, open_max=True)
        check_real('growth_factor', growth_factor, 1.0, math.inf, open_min=True, open_max=True)
        check_real('backoff_factor', backoff_factor, 0.0, 1.0, open_min=True, open_max=True)
        check_int('growth_interval', growth_interval, 1)
        check_int('hysteresis', hysteresis, 1)
        check_real('min_scale', min_scale, 0.0, math.inf, open_min=True, open_max=True)
        check_real('max_scale', max_scale, 0.0, open_min=True, allow_inf=True)
        if min_scale > max_scale:
            raise ValueError('min_scale must be <= max_scale; got min_scale=%r, max_scale=%r'
                             % (min_scale, max_scale))
        if not min_scale <= init_scale <= max_scale:
            raise ValueError('init_scale must be in [min_scale, max_scale] = [%r, %r]; got %r'
                             % (min_scale, max_scale, init_scale))
        check_int('stuck_patience', stuck_patience, 1)
        check_choice('on_stuck', on_stuck, ('warn', 'raise', 'ignore'))
        if warn_backoffs is not None:
            check_int('warn_backoffs', warn_backoffs, 1)
        if warn_skip_fraction is not None:
            check_real('warn_skip_fraction', warn_skip_fraction, 0.0, 1.0, open_min=True)
        check_int('warn_window', warn_window, 1)
        self.init_scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.dynamic = bool(dynamic)
        self.enabled = bool(enabled)
        self.stuck_patience = int(stuck_patience)
        self.on_stuck = on_stuck
        self.warn_backoffs = None if warn_backoffs is None else int(warn_backoffs)
        self.warn_skip_fraction = (None if warn_skip_fraction is None
                                   else float(warn_skip_fraction))
        self.warn_window = int(warn_window)
        self.reset()

    def reset(self) -> None:
        """Back to `init_scale` (1 when disabled), every counter at 0."""
        self._scale = self.init_scale if self.enabled else 1.0
        self.num_good_steps = 0      # finite steps since the last scale change or overflow
        self.num_bad_steps = 0       # overflow steps counted towards hysteresis
        self.total_skipped = 0
        self.total_steps = 0
        self.stuck_steps = 0         # consecutive overflow steps at min_scale
        self._reset_warning()

    def _reset_warning(self) -> None:
        """The early warning's state (not in state_dict: it restarts with a resumed run)."""
        self.backoffs_since_growth = 0
        self._scale_at_growth = self._scale
        self._recent: Deque[bool] = collections.deque(maxlen=self.warn_window)
        self._recent_skipped = 0
        self._descent_warned = self._chronic_warned = False
        self._alert: str | None = None

    @property
    def scale(self) -> float:
        """The current loss scale (1.0 when disabled)."""
        return self._scale

    def update(self, found_overflow: bool) -> bool:
        """Account one step; returns True when the step is to be applied, False to skip.

        Raises `LossScaleStuckError` when ``on_stuck='raise'`` and the scale is stuck (see
        the class docstring)."""
        if not self.enabled:
            return True
        self.total_steps += 1
        recent = self._recent
        if len(recent) == recent.maxlen:
            self._recent_skipped -= recent[0]
        recent.append(bool(found_overflow))
        if found_overflow:
            self._recent_skipped += 1
            self.total_skipped += 1
            self.num_good_steps = 0
            self.num_bad_steps += 1
            self._check_stuck()
            if self.dynamic and self.num_bad_steps >= self.hysteresis:
                before = self._scale
                self._set_scale(max(self._scale * self.backoff_factor, self.min_scale),
                                'overflow')
                self.backoffs_since_growth += self._scale < before
            self._check_falling()
            return False
        self.stuck_steps = 0
        if self._chronic_warned and not self._chronic():
            self._chronic_warned = False
        self.num_good_steps += 1
        if self.consecutive_hysteresis:
            self.num_bad_steps = 0
        if self.dynamic and self.num_good_steps >= self.growth_interval:
            grown = self._scale * self.growth_factor
            before = self._scale
            self._set_scale(min(grown, self.max_scale) if math.isfinite(grown)
                            else self._scale, '%d finite steps' % self.growth_interval)
            if self._scale > before:
                self.backoffs_since_growth = 0
                self._scale_at_growth = self._scale
                self._descent_warned = False
        return True

    def _set_scale(self, new: float, why: str) -> None:
        if new != self._scale:
            _log.info('loss scale %g -> %g (%s)', self._scale, new, why)
        self._scale = new
        self.num_good_steps = 0
        self.num_bad_steps = 0

    def _check_stuck(self) -> None:
        if self._scale > self.min_scale and self.dynamic:
            return
        self.stuck_steps += 1
        if self.stuck_steps < self.stuck_patience or self.on_stuck == 'ignore':
            return
        message = ('loss scale stuck at %g: %d consecutive overflow steps; the model or the '
                   'data produce non-finite gradients at any scale' % (self._scale,
                                                                       self.stuck_steps))
        if self.on_stuck == 'raise':
            raise LossScaleStuckError(message)
        if self.stuck_steps == self.stuck_patience:
            warnings.warn(message, RuntimeWarning)

    def _chronic(self) -> bool:
        return (self.warn_skip_fraction is not None and len(self._recent) == self.warn_window
                and self._recent_skipped >= self.warn_skip_fraction * self.warn_window)

    def _check_falling(self) -> None:
        backoffs = self.backoffs_since_growth
        if (self.warn_backoffs is not None and not self._descent_warned and self.dynamic
                and (backoffs >= self.warn_backoffs
                     or (backoffs >= 2 and self.min_scale < self._scale
                         and self._scale * self.backoff_factor <= self.min_scale))):
            self._descent_warned = True
            self._alert = ('loss scale falling: %d backoffs without a growth, %g -> %g '
                           '(min_scale %g)' % (backoffs, self._scale_at_growth, self._scale,
                                               self.min_scale))
        elif not self._chronic_warned and self._chronic():
            self._chronic_warned = True
            # _chronic() holds only with a warn_skip_fraction (not None)
            self._alert = ('%d of the last %d steps skipped (warn_skip_fraction %g); loss '
                           'scale %g' % (self._recent_skipped,  # type: ignore[str-format]
                                         self.warn_window, self.warn_skip_fraction,
                                         self._scale))

    def take_alert(self) -> str | None:
        """The early warning's text once it fired (then None until it fires again)."""
        alert, self._alert = self._alert, None
        return alert

    _WARNING_STATE = ('backoffs_since_growth', '_scale_at_growth', '_recent', '_recent_skipped',
                      '_descent_warned', '_chronic_warned', '_alert')

    def __getstate__(self) -> dict[str, Any]:
        # the early warning restarts after a copy or a checkpoint, which holds plain values
        return {k: v for k, v in self.__dict__.items() if k not in self._WARNING_STATE}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__dict__.update(state)
        for key, default in (('warn_backoffs', 8), ('warn_skip_fraction', 0.05),
                             ('warn_window', 1000)):     # pickled before these existed
            self.__dict__.setdefault(key, default)
        self._reset_warning()

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Everything needed to resume, configuration included (plain Python values)."""
        config = {k: getattr(self, k) for k in (
            'init_scale', 'growth_factor', 'backoff_factor', 'growth_interval', 'hysteresis',
            'consecutive_hysteresis', 'min_scale', 'max_scale', 'dynamic', 'enabled',
            'stuck_patience', 'on_stuck', 'warn_backoffs', 'warn_skip_fraction',
            'warn_window')}
        state = {k: getattr(self, '_scale' if k == 'scale' else k) for k in self._STATE}
        return {'config': config, 'state': state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume a `state_dict` in place (configuration included). Raises ValueError,
        before anything changes, when it is not a valid DynamicLossScaler state."""
        try:
            config, state = state_dict['config'], state_dict['state']
            fresh = DynamicLossScaler(**config)       # validates the configuration
            missing = [k for k in self._STATE if k not in state]
        except (KeyError, TypeError) as err:
            raise ValueError('not a DynamicLossScaler state_dict: %s' % err) from None
        if missing:
            raise ValueError('DynamicLossScaler state_dict lacks %s' % ', '.join(missing))
        try:                       # every value converted before this scaler changes
            scale = float(state['scale'])
            counters = {key: int(state[key]) for key in self._STATE[1:]}
        except (TypeError, ValueError) as err:
            raise ValueError('not a DynamicLossScaler state_dict: %s' % err) from None
        if not 0 < scale < float('inf'):
            raise ValueError('DynamicLossScaler state_dict has scale %r; expected a finite '
                             'positive number' % (scale,))
        self.__dict__.update(fresh.__dict__)
        self._scale = scale
        self.__dict__.update(counters)

    def __repr__(self) -> str:
        return ('DynamicLossScaler(scale=%g, good=%d, bad=%d, skipped=%d/%d)'
                % (self._scale, self.num_good_steps, self.num_bad_steps, self.total_skipped,
                   self.total_steps))

    @classmethod
    def static(cls, scale: float) -> DynamicLossScaler:
        """A fixed scale that still skips overflow steps."""
        return cls(init_scale=scale, min_scale=min(1.0, scale), max_scale=max(scale, 2.0 ** 24),
                   dynamic=False)


def as_scaler(value: DynamicLossScaler | float | None,
              name: str = 'loss_scaler') -> DynamicLossScaler:
    """A DynamicLossScaler from an instance, a float (static scale) or None (defaults).

    Parameters
    ----------
    value : DynamicLossScaler, float or None
        An instance is returned as it is; a number gives ``DynamicLossScaler.static(value)``
        (a fixed scale that still skips overflow steps); None a scaler with the defaults.
    name : str, default 'loss_scaler'
        The argument's name, for the error message.

    Returns
    -------
    DynamicLossScaler

    Raises
    ------
    TypeError
        `value` is none of those (a bool or a str, say).

    Examples
    --------
    >>> from mx_lbsgd.loss_scaling import as_scaler
    >>> as_scaler(128.0)
    DynamicLossScaler(scale=128, good=0, bad=0, skipped=0/0)
    >>> as_scaler(128.0).dynamic, as_scaler(None).scale
    (False, 65536.0)
    >>> as_scaler('big')
    Traceback (most recent call last):
    ...
    TypeError: loss_scaler must be a DynamicLossScaler, a float (static scale) or None; got 'big'
    """
    if value is None:
        return DynamicLossScaler()
    if isinstance(value, DynamicLossScaler):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return DynamicLossScaler.static(float(value))
    raise TypeError('%s must be a DynamicLossScaler, a float (static scale) or None; got %r'
                    % (name, value))
