"""Gradient accumulation at a gluon Trainer's reduction: communicate once per update.

`LBSGD(batch_scale=B)` under a Trainer whose kvstore does not update the weights (no
kvstore, ``device``/``dist_*`` with ``update_on_kvstore=False``, horovod's
``DistributedTrainer``): the user's loop still calls ``trainer.step`` after every
micro-batch. For micro-batches 1..B-1 of a window the Trainer's reduction is replaced by a
local sum, per device, into the float32 accumulator of the optimizer state::

    acc = r_1 * g_1 + ... + r_{B-1} * g_{B-1}          # r_j: rescale_grad of micro-batch j

and the optimizer only counts the micro-batch. On micro-batch B the window's mean is written
back into the gradient buffers, in units of that micro-batch's rescale_grad, and reduced
once; the optimizer then applies it as a plain step::

    g_B = (acc + r_B * g_B) / (r_B * B)                 # then allreduce, then the update

The communicated values have the magnitude of one micro-batch's (scaled) gradient, so an
fp16 gradient or fp16 compression overflows no sooner than without accumulation, and an
inf/NaN from any micro-batch of any worker reaches every worker: a loss-scaled optimizer
skips the whole window everywhere.
"""
from . import _compat, _kernels


def attach(trainer, optimizer):
    """`lbsgd._TRAINER_STEP_HOOKS` entry: install the window on `trainer` once."""
    if optimizer.batch_scale > 1:
        _compat.wrap_trainer_allreduce(trainer, lambda original: _Window(trainer, original))


def disable(trainer):
    """Reduce every micro-batch on `trainer` (the optimizer accumulates after the reduction):
    for the `LossScaling` hook, which checks every micro-batch's reduced gradients."""
    trainer._mx_lbsgd_no_window = True


class _Window:
    def __init__(self, trainer, original):
        self.trainer = trainer
        self.original = original
        self._accs = {}        # id(state) -> (state, accumulator): split once per state
        self._sparse = None    # whether any gradient is sparse (fixed per Trainer)

    def __call__(self):
        trainer, opt = self.trainer, self.trainer.optimizer
        if self._sparse is None:
            self._sparse = _compat.has_sparse_gradients(trainer)
        if (getattr(trainer, '_mx_lbsgd_no_window', False) or getattr(opt, 'batch_scale', 1) < 2
                or _compat.trainer_updates_on_kvstore(trainer) or self._sparse):
            # sparse gradients: MXNet's Trainer pushes and pulls them separately, row by
            # row; they are accumulated after that reduction, by the optimizer
            opt.window_phase = None          # the kvstore's updater accumulates
            return self.original()
        position = opt.window_position + 1
        grads, accs = self._buffers(trainer, opt)
        factor = opt.rescale_grad
        if position < opt.batch_scale:
            _kernels.accumulate(accs=accs, grads=grads, first=position == 1, factor=factor,
                                scratch=opt._scratch)
            opt.window_position, opt.window_phase = position, 'partial'
            return None
        _kernels.write_mean(grads=grads, accs=accs, factor=factor,
                            mean_factor=1.0 / (factor * opt.batch_scale), scratch=opt._scratch)
        opt.window_position, opt.window_phase = 0, 'final'
        return self.original()

    def _buffers(self, trainer, opt):
        """The fresh gradients and their accumulators (created in the Updater's states when
        the Updater has not created them yet), device by device."""
        grads, accs, used, missed = [], [], {}, False
        updaters = _compat.trainer_updaters(trainer)
        for i, param in enumerate(_compat.trainer_params(trainer)):
            if param.grad_req == 'null':
                continue
            for updater, weight, grad in zip(updaters, param.list_data(), param.list_grad()):
                if not _compat.is_fresh(weight):
                    continue
                weight, grad = _compat.legacy(weight), _compat.legacy(grad)
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
