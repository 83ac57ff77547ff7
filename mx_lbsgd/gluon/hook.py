"""`LossScaling`: dynamic loss scaling for any `gluon.Trainer` and any optimizer."""
from __future__ import annotations

import warnings
import weakref
from typing import (Any, Counter, Deque, Dict, Iterable, List, Optional, Sequence, Tuple,
                    Union, cast)

import numpy as np
import mxnet as mx

from .. import _compat, _kernels
from .._checks import check_choice, check_int, check_real
from ..loss_scaling import gate as _scaling, overflow
from ..loss_scaling.scaler import DynamicLossScaler, as_scaler
from ..pipeline import clip as _clip
from . import binding as _binding


class LossScaling:
    """Attach dynamic loss scaling to one or several ``gluon.Trainer`` objects::

        scaling = mx_lbsgd.LossScaling(trainer)          # or [trainer_a, trainer_b]
        with autograd.record():
            loss = loss_fn(net(x), y)
            scaled = scaling.scale_loss(loss)            # loss * scale
        scaled.backward()
        applied = scaling.step(batch_size)               # check, skip or apply, adjust scale

    With ``max_grad_norm``, `step` also clips the gradient the update applies to that
    global L2 norm: the gradients as they stand at `step` (with grad_req='add', the
    window's sum), unscaled, reduced, times the update's rescale_grad; ``c = min(1,
    max_grad_norm / (norm + 1e-6))`` is folded into ``Trainer.update``'s rescale_grad, so
    no gradient is rewritten. The norm's sum-of-squares pass is also the finite check, and
    its value is the one host read of the step. A non-finite norm skips the step (and with
    loss scaling backs off the scale); ``last_grad_norm`` holds the norm.
    For ``LBSGD``/``LAMB`` with ``batch_scale > 1``, each `step` is one micro-batch: clip in
    the optimizer instead (its own ``max_grad_norm``), which sees the window's mean.
    `unscale` + `clip_global_norm` remain for hand-written clipping of one step's gradients.

    `step` all-reduces the gradients (Trainer.allreduce_grads), checks every gradient of
    every trainer on every device on the device, reads one flag back to the host, and then
    either skips the update (no weight, momentum or master copy changes) or runs
    ``Trainer.update(batch_size * scale)``, which folds 1/scale into the optimizer's
    rescale_grad, so unscaling costs no extra pass. The scaler is updated once per step,
    skipped or not. With gradient accumulation (grad_req='add'), call `step` once per
    update: the scale stays fixed inside the window. With ``LBSGD(batch_scale>1)`` every
    micro-batch is a step of the hook, unscaled as it is accumulated, and the gradients are
    reduced every micro-batch (``LBSGD(loss_scaler=...)`` reduces once per window).

    Differences from MXNet's contrib.amp: any Optimizer, configurable and checkpointable
    scaler (`scaler.state_dict()`), every device's gradient copy checked, fp16 and fp32
    gradients mixed, several trainers sharing one scaler.

    Parameters
    ----------
    trainers : gluon.Trainer or list of them (each with update_on_kvstore=False)
    scaler : DynamicLossScaler, float (a static scale) or None (the defaults)
    force : bool
        Scale even when no gradient is float16 (otherwise that is a no-op with a warning).
    fused : None or bool
        Overflow-check kernels: see `LBSGD(fused=...)`.
    history_size : int >= 0, default 32
        Overflow reports kept in ``overflow_history``.
    log_interval : float >= 0, default 30
        Seconds between two log records of skipped steps (logger 'mx_lbsgd', INFO; the
        next record counts the ones left out).
    check_local : bool, default False
        On a distributed job, keep a device-side finite flag of this worker's gradients
        before the all-reduce, so a report can say whether this worker overflowed (one
        finite check per step more; never read on a finite step).
    max_grad_norm : None or float >= 0, default None
        Clip the applied gradient to this global L2 norm (None or 0: no clipping).
    alert : {'warn', 'log'}, default 'warn'
        Where the falling-scale alert goes: ``warnings.warn(LossScaleFallingWarning)`` (a
        RuntimeWarning, for warnings filters) or a WARNING record on logger 'mx_lbsgd',
        never both. Skipped steps are INFO records on that logger either way (their text
        names the 5 parameters with the most non-finite values, then "and N more").

    After a skipped step ``last_overflow`` is an `OverflowReport` (None after a finite
    step); ``overflow_history`` and ``overflow_tally`` keep the recent ones.

    Raises
    ------
    TypeError
        `trainers` is not a gluon.Trainer or a non-empty list of them, or a number of the
        wrong type.
    ValueError
        A trainer is a `ShardedTrainer`, its optimizer has a ``loss_scaler`` of its own,
        ``max_grad_norm`` is negative or meets an optimizer that clips or accumulates
        (``batch_scale > 1``) itself, ``alert`` is not 'warn' or 'log', or another argument
        is out of range (each before any trainer is bound). At the first
        `step`: a trainer with ``update_on_kvstore=True``.

    Examples
    --------
    Any optimizer (here MXNet's ``'sgd'``); float32 gradients need ``force=True`` (float16
    ones are scaled without it):

    >>> import mxnet as mx
    >>> from mxnet import autograd, gluon, nd
    >>> import mx_lbsgd
    >>> net = gluon.nn.Dense(1, in_units=2, prefix='fc_')
    >>> net.initialize(mx.init.One())
    >>> trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
    ...                         update_on_kvstore=False)
    >>> scaling = mx_lbsgd.LossScaling(trainer, mx_lbsgd.DynamicLossScaler(init_scale=8.0),
    ...                                force=True)
    >>> def train_step(x):
    ...     with autograd.record():
    ...         loss = scaling.scale_loss(net(nd.array(x)).sum())
    ...     loss.backward()
    ...     return scaling.step(1)
    >>> train_step([[1.0, 2.0]]), scaling.scale
    (True, 8.0)
    >>> print(net.weight.data().asnumpy().round(4))     # unscaled: w - 0.1 * gradient
    [[0.9 0.8]]
    >>> train_step([[float('inf'), 2.0]]), scaling.scale
    (False, 4.0)
    >>> print(scaling.last_overflow)
    step 2 skipped (loss scale 8 -> 4): fc_weight inf (1).
    """

    def __init__(self, trainers: Union[mx.gluon.Trainer, Iterable[mx.gluon.Trainer]],
                 scaler: Union[DynamicLossScaler, float, None] = None, force: bool = False,
                 fused: Optional[bool] = None, history_size: int = overflow.HISTORY_SIZE,
                 log_interval: float = overflow.LOG_INTERVAL,
                 check_local: bool = False, max_grad_norm: Optional[float] = None,
                 alert: str = overflow.ALERT) -> None:
        check_choice('alert', alert, overflow.ALERT_CHANNELS)
        self.trainers = [trainers] if isinstance(trainers, mx.gluon.Trainer) else list(trainers)
        if not self.trainers or not all(isinstance(t, mx.gluon.Trainer) for t in self.trainers):
            raise TypeError('trainers must be a gluon.Trainer or a list of them; got %r'
                            % (trainers,))
        for t in self.trainers:
            if hasattr(t, 'step_sum_of_squares'):
                raise ValueError('LossScaling cannot drive a ShardedTrainer: after its '
                                 'exchange each rank holds only the gradients it owns. Pass '
                                 "loss_scaler=... (and max_grad_norm=...) to the optimizer")
            if getattr(t.optimizer, 'loss_scaler', None) is not None:
                raise ValueError('LossScaling: the optimizer %s already scales the loss '
                                 '(loss_scaler=%r); use one of the two, not both'
                                 % (type(t.optimizer).__name__, t.optimizer.loss_scaler))
        if max_grad_norm is not None:
            check_real('max_grad_norm', max_grad_norm, 0.0)
        for t in self.trainers if max_grad_norm else ():
            _refuse_double_clipping(t.optimizer)
        self.max_grad_norm = float(max_grad_norm) if max_grad_norm else None
        #: the global norm of the last step's applied gradient (before clipping), a (1,)
        #: NDArray (None without max_grad_norm, or before the first step)
        self.last_grad_norm: Optional[mx.nd.NDArray] = None
        self.scaler = as_scaler(scaler, 'scaler')
        self.force = bool(force)
        self.fused = check_choice('fused', fused, (None, True, False))
        self.last_step_skipped = False
        self.check_local = check_choice('check_local', check_local, (False, True))
        self._overflow = overflow.OverflowMonitor(
            check_int('history_size', history_size, 0),
            check_real('log_interval', log_interval, 0.0, allow_inf=True), alert)
        self._local_flag: Optional[mx.nd.NDArray] = None
        self._active: Optional[bool] = None     # decided on first use, once gradients exist
        self._reduced = False
        self._unscaled = False
        # per trainer, the mean-over-workers factor unscale() used
        self._means: Optional[List[float]] = None
        # of the last step() (GradientNoiseScale reads it)
        self.batch_size: Optional[int] = None
        for t in self.trainers:
            _binding.bind(t, window=False).loss_scaling = weakref.ref(self)

    @property
    def last_overflow(self) -> Optional[overflow.OverflowReport]:
        """The `OverflowReport` of the last step if it was skipped, else None."""
        return self._overflow.last

    @property
    def overflow_history(self) -> Deque[overflow.OverflowReport]:
        """The last reports (a deque, oldest first)."""
        return self._overflow.history

    @property
    def overflow_tally(self) -> Counter[str]:
        """How many skipped steps each parameter overflowed in, as a Counter (by name)."""
        return self._overflow.tally

    @property
    def scale(self) -> float:
        """The loss scale to multiply the loss by (1.0 while scaling is off)."""
        return self.scaler.scale if self._is_active() else 1.0

    def _params(self, trainers: Optional[Sequence[mx.gluon.Trainer]] = None
                ) -> List[mx.gluon.Parameter]:
        return [p for t in (self.trainers if trainers is None else trainers)
                for p in _compat.trainer_params(t) if p.grad_req != 'null']

    def _grads(self, trainers: Optional[Sequence[mx.gluon.Trainer]] = None
               ) -> List[mx.nd.NDArray]:
        return [_compat.legacy(g) for p in self._params(trainers) for g in p.list_grad()]

    def _is_active(self) -> bool:
        if self._active is None:
            params = self._params()
            if not params:
                return self.scaler.enabled      # deferred init: decide once grads exist
            fp16 = any(np.dtype(p.dtype) == np.float16 for p in params)
            self._active = self.scaler.enabled and (fp16 or self.force)
            if self.scaler.enabled and not fp16 and not self.force:
                warnings.warn('LossScaling: no float16 gradient, so loss scaling is off '
                              '(pass force=True to scale float32 gradients anyway)')
        return self._active

    def _prepare(self) -> None:
        for t in self.trainers:
            _compat.init_trainer_kvstore(t)
            if _compat.trainer_updates_on_kvstore(t):
                _scaling.refuse_kvstore_updates('LossScaling')
        if not self._reduced:
            if self.check_local and self._is_active() and self._workers()[1] > 1:
                self._local_flag = _kernels.finite_flag(self._grads(), self.fused)
            for t in self.trainers:
                t.allreduce_grads()
            self._reduced = True

    def scale_loss(self, loss: Union[mx.nd.NDArray, List[mx.nd.NDArray],
                                     Tuple[mx.nd.NDArray, ...]]
                   ) -> Union[mx.nd.NDArray, List[mx.nd.NDArray]]:
        """loss * scale (a list of losses gives a list)."""
        scale = self.scale
        if isinstance(loss, (list, tuple)):
            return [l * scale for l in loss]
        return loss * scale

    def unscale(self) -> None:
        """All-reduce, then divide the gradients by the scale in place, e.g. before clipping.

        Afterwards every device's gradient holds the mean over workers of each worker's
        gradient (summed over its samples and devices), whatever the engine: MXNet's
        reductions sum over workers (``dist_*`` kvstores, Horovod on CPU/gloo) or average
        (Horovod with NCCL >= 2.10), and the factor that makes the mean is folded into the
        same pass (`step` folds it back into ``rescale_grad``, so the update is unchanged).
        One worker's gradients are only divided by the scale."""
        if self._unscaled:
            raise RuntimeError('unscale() was already called since the last step()')
        self._prepare()
        scale = self.scaler.scale if self._is_active() else 1.0
        self._means = [_compat.reduced_gradient_mean_factor(t) for t in self.trainers]
        for trainer, mean in zip(self.trainers, self._means):
            if mean / scale != 1.0:
                _kernels.scale_in_place(self._grads([trainer]), mean / scale)
        self._unscaled = True

    def clip_global_norm(self, max_norm: float) -> mx.nd.NDArray:
        """Clip the unscaled gradients to a global L2 norm of `max_norm` on each device
        (the norm of the mean over workers, see `unscale`: the same threshold on one
        worker or many). Returns the norm (an NDArray on the first device) without a host
        sync."""
        if not self._unscaled:
            raise RuntimeError('call unscale() before clip_global_norm(): the gradients are '
                               'still multiplied by the loss scale')
        by_ctx: Dict[Any, List[mx.nd.NDArray]] = {}
        for g in self._grads():
            by_ctx.setdefault(g.context, []).append(g)
        norms = [mx.gluon.utils.clip_global_norm(grads, max_norm, check_isfinite=False)
                 for grads in by_ctx.values()]
        return norms[0]

    def step(self, batch_size: int, ignore_stale_grad: bool = False) -> bool:
        """Check, then apply or skip the update, then adjust the scale. True if applied."""
        self.batch_size = batch_size
        self._prepare()
        active = self._is_active()
        scale = self.scaler.scale
        clip = 1.0
        if self.max_grad_norm is not None:
            norm = self._measure(batch_size, scale if active else 1.0)
            finite = bool(np.isfinite(norm))
            clip = _clip.coefficient(self.max_grad_norm, norm) if finite else 1.0
            applied = (not active or _scaling.decide(
                self.scaler, self._grads(), self.fused, lambda grads, fused: finite)) and finite
            if not finite and not active:
                warnings.warn('LossScaling: the gradient norm is not finite; the update was '
                              'skipped', RuntimeWarning)
        else:
            applied = not active or _scaling.decide(self.scaler, self._grads(), self.fused)
        if active and applied:
            self._overflow.finite()
        elif active:
            self._report(scale)
        self._local_flag = None
        for t in self.trainers:
            account = getattr(t.optimizer, 'step_outside', None)
            if account is not None:       # an mx_lbsgd optimizer: count_skipped_steps etc.
                account(applied)
        if applied:
            unscale = 1.0 if (self._unscaled or not active) else _scaling.unscale_factor(scale)
            # (unscale() set self._means)
            for t, mean in zip(self.trainers, cast(List[float], self._means) if self._unscaled
                               else [1.0] * len(self.trainers)):
                # after unscale() the gradients hold the mean over workers: the update's
                # rescale_grad (Trainer scale / batch) takes the factor back
                t.update(batch_size / unscale * mean / clip, ignore_stale_grad)
        self.last_step_skipped = not applied
        self._reduced = self._unscaled = False
        return applied

    def _measure(self, batch_size: int, scale: float) -> float:
        """The global norm of what `step` would apply (each parameter's first device copy:
        after the reduction they are equal), kept in ``last_grad_norm``; one host read."""
        if self._unscaled:          # gradients / scale * mean: the update divides by mean
            factors = [_compat.trainer_scale(t) / (batch_size * mean)
                       for t, mean in zip(self.trainers, cast(List[float], self._means))]
        else:
            factors = [_compat.trainer_scale(t) / (batch_size * scale) for t in self.trainers]
        groups = [([_compat.legacy(p.list_grad()[0]) for p in self._params([t])], f)
                  for t, f in zip(self.trainers, factors)]
        self.last_grad_norm = _clip.norm_of([g for g in groups if g[0]])
        return float(self.last_grad_norm.asscalar())

    def _workers(self) -> Tuple[Optional[int], int]:
        return overflow.step_worker(self.trainers[0])

    def _report(self, scale: float) -> None:
        named = [(p.name, _compat.legacy(g)) for p in self._params() for g in p.list_grad()]
        # an mx_lbsgd optimizer accumulating after the reduction: each micro-batch is a step
        self._overflow.report_skip(
            scaler=self.scaler, scale=scale, named_grads=named,
            optimizer=self.trainers[0].optimizer, trainer=self.trainers[0],
            local_flags=None if self._local_flag is None else {0: self._local_flag})


def _refuse_double_clipping(optimizer: mx.optimizer.Optimizer) -> None:
    """max_grad_norm on the hook: not with an optimizer that clips or accumulates itself."""
    if getattr(optimizer, 'max_grad_norm', None):
        raise ValueError('LossScaling(max_grad_norm=...): the optimizer %s already clips '
                         '(max_grad_norm=%r); use one of the two, not both'
                         % (type(optimizer).__name__, optimizer.max_grad_norm))
    if getattr(optimizer, 'batch_scale', 1) > 1:
        raise ValueError('LossScaling(max_grad_norm=...): the optimizer %s accumulates '
                         'batch_scale=%d micro-batches itself, so each step() of the hook is '
                         "one micro-batch; pass max_grad_norm to the optimizer, which clips "
                         "the window's mean" % (type(optimizer).__name__,
                                                optimizer.batch_scale))
