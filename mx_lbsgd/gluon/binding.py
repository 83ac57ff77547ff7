"""The step protocol: one object binds a gluon Trainer to an mx_lbsgd optimizer.

A `TrainerBinding` routes the Trainer's reduction and update (`_compat.wrap_trainer_step`)
and owns what happens between them::

    trainer.step(batch_size)
      reduce:  optimizer.begin_micro_batch (a chosen window length takes effect)
               refuse a kvstore that updates the weights (loss scaling)
               local flag: a device-side finite flag of this worker's gradients, kept for
                       an overflow report (per micro-batch of a window, out of the
                       window's own pass; per step with check_local_overflow on a dist
                       job); never read on finite steps
               window: micro-batch < B: sum it locally into the accumulators, do not reduce
                       micro-batch = B: write the window's mean into the gradients, reduce
      (before and after the reduction: optimizer.observe_micro_batch / observe_reduction,
       for its lr_scaling's norms)
      update:  optimizer.begin_step(every fresh gradient, closes_window, trainer,
                                    local flags)                          # the event
               then MXNet's per-device Updaters call optimizer.update_multi_precision

The optimizer learns nothing from attribute writes: it gets `begin_step`. The window's
position is read from the optimizer's micro-batch count at each reduction, so whatever
restores the counters (`mx_lbsgd.checkpoint`, MXNet's ``Trainer.load_states``) restores the
window. A Trainer is bound at its first step (or by `bind`), once.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import mxnet as mx

from .. import _compat, _kernels
from ..pipeline.servers import refuse_sparse_gradients_on_servers
from ..pipeline.step_info import TrainerSide
from .window import TrainerWindow

if TYPE_CHECKING:
    from ..pipeline.optimizer_view import StepOptimizer

_BINDINGS: weakref.WeakKeyDictionary[mx.gluon.Trainer, TrainerBinding] = \
    weakref.WeakKeyDictionary()


def bind(trainer: mx.gluon.Trainer, window: bool = True) -> TrainerBinding:
    """The Trainer's binding, created on first use. window=False reduces every micro-batch
    from now on (the optimizer accumulates after the reduction)."""
    binding = _BINDINGS.get(trainer)
    if binding is None:
        binding = _BINDINGS[trainer] = TrainerBinding(trainer)
    if not window:
        binding.window_at_reduction = False
    return binding


def bound(trainer: mx.gluon.Trainer) -> Optional[TrainerBinding]:
    """The Trainer's binding, or None."""
    return _BINDINGS.get(trainer)


def loss_scaling_of(trainer: mx.gluon.Trainer) -> Optional[Any]:
    """The `LossScaling` hook attached to `trainer` last (alive), or None (typed Any: the
    hook's module imports this one)."""
    binding = _BINDINGS.get(trainer)
    ref = None if binding is None else binding.loss_scaling
    return None if ref is None else ref()


class TrainerBinding:
    def __init__(self, trainer: mx.gluon.Trainer) -> None:
        self._trainer = weakref.ref(trainer)
        self.window_at_reduction = True
        self.window = TrainerWindow()
        # what the last reduction did to the window
        self._closes: Optional[bool] = None
        # {micro-batch (0: the step): device-side finite flag}
        self._flags: Optional[Dict[int, mx.nd.NDArray]] = None
        # id(state) -> (state, accumulator): split once per state
        self._accs: Dict[int, Tuple[Any, Optional[mx.nd.NDArray]]] = {}
        self._sparse = _compat.has_sparse_gradients(trainer)
        # read-only watchers of the gradients (GradientNoiseScale): before_reduction(trainer,
        # info) per micro-batch, after_reduction(trainer, info, closes_window) per
        # reduction, `info` the optimizer's StepInfo
        self.observers: List[Any] = []
        # weakref to the LossScaling hook over this Trainer (its scaler goes into
        # mx_lbsgd.checkpoint files), or None
        self.loss_scaling: Optional[weakref.ref[Any]] = None
        # a dist kvstore's first reduction waits for the initial weights' pull
        self._weights_pulled = False
        if hasattr(trainer.optimizer, 'begin_step'):
            _refuse_dist_sparse_gradients(trainer)
        _compat.wrap_trainer_step(trainer, self._reduce, self._update)

    def windows_at_reduction(self) -> bool:
        """Whether this Trainer keeps accumulation windows at its reduction (dense
        gradients, and no hook that reduces every micro-batch)."""
        return self.window_at_reduction and not self._sparse

    def _optimizer(self) -> Optional[StepOptimizer]:
        # (the Trainer is alive: this runs inside its step)
        opt = self._trainer().optimizer  # type: ignore[union-attr]
        return opt if hasattr(opt, 'begin_step') else None

    def _reduce(self, original: Callable[[], Any]) -> Any:
        trainer, opt = self._trainer(), self._optimizer()
        if not self._weights_pulled:
            self._weights_pulled = True
            _wait_for_initial_weights(trainer)
        self._closes = None
        if opt is None:
            return original()
        side = self._side(trainer)
        opt.begin_micro_batch(side)
        for observer in list(self.observers):
            observer.before_reduction(trainer, opt.step_info(side))
        opt.observe_micro_batch(side, self.window_at_reduction and not self._sparse
                                and opt.accumulates_at_trainer())
        if _compat.trainer_updates_on_kvstore(trainer):
            opt.refuse_updates_on_kvstore()
            return original()
        if not (self.window_at_reduction and opt.accumulates_at_trainer()) or self._sparse:
            # sparse gradients: MXNet's Trainer pushes and pulls them separately, row by
            # row; they are accumulated after that reduction, by the optimizer
            if opt.wants_local_flags(trainer, window=False):
                self._flags = {0: _kernels.finite_flag(
                    _compat.fresh_gradients(opt.param_dict), opt.fused)}
            return self._reduced(original, side, opt, False)
        grads, accs = self._buffers(trainer, opt)
        position = opt.window_position
        check = opt.wants_local_flags(trainer, window=True)
        # the flag comes out of the window's own pass (one native call per device on CPU)
        self._closes = self.window.add(accs=accs, grads=grads, rescale_grad=opt.rescale_grad,
                                       size=opt.batch_scale, position=position,
                                       check_finite=check, fused=opt.fused)
        if check:
            if position == 0 or self._flags is None:
                self._flags = {}
            self._flags[position + 1] = self.window.flag
        return self._reduced(original, side, opt, True) if self._closes else None

    def _side(self, trainer: mx.gluon.Trainer) -> TrainerSide:
        """What the optimizer's gain pieces are handed of this Trainer: its windows, and
        the `LossScaling` hook over it."""
        hook = None if self.loss_scaling is None else self.loss_scaling()
        return TrainerSide(trainer, self.windows_at_reduction(), hook)

    def _reduced(self, original: Callable[[], Any], side: TrainerSide,
                 opt: StepOptimizer, closes_window: bool) -> Any:
        result = original()
        for observer in self.observers:
            observer.after_reduction(side.trainer, opt.step_info(side), closes_window)
        opt.observe_reduction(side, closes_window)
        return result

    def _update(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        opt = self._optimizer()
        if opt is not None:
            trainer = self._trainer()
            if _compat.trainer_updates_on_kvstore(trainer):
                opt.refuse_updates_on_kvstore()
            fresh = (_compat.fresh_gradients(opt.param_dict)
                     if opt.wants_step_gradients() else None)
            # a sharded Trainer's sum of squares over every rank's shard, and the pieces of
            # the tensors it split over ranks
            sum_sq = getattr(trainer, 'step_sum_of_squares', lambda: None)()
            slices = getattr(trainer, 'step_slice_norms', lambda: None)()
            opt.begin_step(fresh, self._closes, trainer=trainer,
                           local_flags=None if self._closes is False else self._flags,
                           sum_sq=None if self._closes is False else sum_sq,
                           slices=None if self._closes is False else slices)
        if self._closes is not False:
            self._flags = None
        self._closes = None
        return original(*args, **kwargs)

    def _buffers(self, trainer: mx.gluon.Trainer, opt: StepOptimizer
                 ) -> Tuple[List[mx.nd.NDArray], List[Optional[mx.nd.NDArray]]]:
        """The fresh gradients and their accumulators (created in the Updater's states when
        the Updater has not created them yet), device by device."""
        grads: List[mx.nd.NDArray] = []
        accs: List[Optional[mx.nd.NDArray]] = []
        used: Dict[int, Tuple[Any, Optional[mx.nd.NDArray]]] = {}
        missed = False
        updaters = _compat.trainer_updaters(trainer)
        # a sharded Trainer keeps the accumulators of the parameters it does not own
        own_accumulator = getattr(trainer, 'window_accumulator', None)
        for i, param in enumerate(_compat.trainer_params(trainer)):
            if param.grad_req == 'null':
                continue
            for updater, weight, grad in zip(updaters, param.list_data(), param.list_grad()):
                if not _compat.is_fresh(weight):
                    continue
                weight, grad = _compat.legacy(weight), _compat.legacy(grad)
                if own_accumulator is not None:
                    grads.append(grad)
                    accs.append(own_accumulator(i, weight))
                    continue
                state = _compat.updater_state(updater, i, weight)
                cached = self._accs.get(id(state))
                if cached is None or cached[0] is not state:
                    cached = (state, opt.split_state(weight, state)[2])
                    missed = True
                used[id(state)] = cached
                grads.append(grad)
                accs.append(cached[1])
        if missed:                   # states were created or replaced (load_states)
            self._accs = used
        return grads, accs


def _wait_for_initial_weights(trainer: mx.gluon.Trainer) -> None:
    """On a dist kvstore, wait (once, at the first reduction) for the pull of the initial
    weights that ``Trainer.step`` issued just before (``_init_params``: the kvstore's
    ``broadcast``). MXNet 1.9.1 does not order that pull with the first gradient push of
    the same key (different arrays), so a fast peer's push could complete the servers'
    first sum before this worker's pull was served, and the worker would load the gradient
    sum as its weights (``docs/distributed/index.md``, "An MXNet 1.9.1 race")."""
    kind = _compat.trainer_kvstore_type(trainer)
    if kind and kind.startswith('dist'):
        for param in _compat.trainer_params(trainer):
            try:
                arrays = param.list_data()
            except RuntimeError:     # row_sparse weights: initialized on the servers, no pull
                continue
            for data in arrays:
                data.wait_to_read()


def _refuse_dist_sparse_gradients(trainer: mx.gluon.Trainer) -> None:
    """Checked when a Trainer is bound (its first step), before its kvstore exists."""
    kind = _compat.trainer_kvstore_type(trainer)
    if kind and kind.startswith('dist'):
        refuse_sparse_gradients_on_servers(_compat.dense_weights_with_sparse_gradients(trainer),
                                           kind, type(trainer.optimizer).__name__)
