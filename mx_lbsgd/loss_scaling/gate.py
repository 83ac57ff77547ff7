"""The one loss-scaling core: finite check, step-level skip decision, scaler update,
1/scale folding and the refusal texts. Used by the loss-scaled optimizers (through
`StepGate`) and by the `LossScaling` Trainer hook (through `decide`).

MXNet's Updater calls an optimizer several times per step: once per device (Gluon keeps one
Updater per device, Module one for all) and, within a device, once per weight dtype. A skip
decided call by call could apply the float32 group and skip the float16 one. `StepGate`
decides once per step instead, with one host read:

- Gluon (firm signal): ``Trainer.step``/``update`` set the optimizer's ``rescale_grad``
  first; the optimizer then lists every fresh gradient of every parameter on every device
  and hands them to `new_step`. The first call of the step decides over all of them; no
  call is held back and no later call needs a check.
- Module or a bare Updater: nothing announces a step. The gate holds calls back until the
  Updater round has delivered every (context, index) key of the previous round; in the
  first round, every key whose state the Updater just created (it creates a call's states
  before it updates any of them). A step ends when a key repeats. A gradient that turns up
  after the decision without having been checked (a second device in Module's first step)
  is checked on its own and, if it overflows, its group is skipped with a warning.
"""
import warnings

from .. import _compat, _kernels

_KVSTORE_REFUSAL = (
    '%s cannot run with update_on_kvstore=True: the kvstore updates each parameter as soon '
    'as its gradient arrives, so an overflow step cannot be skipped as a whole. Use '
    'gluon.Trainer(..., update_on_kvstore=False), or for Module set the environment '
    'variable MXNET_UPDATE_ON_KVSTORE=0')


def refuse_kvstore_updates(owner):
    """Raise the one refusal of loss scaling on a kvstore that updates the weights.
    `owner` names who refuses (an optimizer class name, or 'LossScaling')."""
    raise ValueError(_KVSTORE_REFUSAL % owner)


def all_finite(grads, fused):
    """True when every element of every gradient is finite (one host read)."""
    return bool(_kernels.finite_flag(grads, fused).asscalar())


def decide(scaler, grads, fused, check=all_finite):
    """One loss-scaling step: check `grads`, account the result in `scaler` (grow, back
    off, count). Returns True when the step is to be applied."""
    if not scaler.enabled:
        return True
    return scaler.update(not check(grads, fused))


def unscale_factor(scale):
    """The factor folded into the update's ``rescale_grad`` for gradients carrying `scale`."""
    return 1.0 / scale


def _handle(array):
    return _compat.buffer_id(array)


class StepGate:
    """Step-level all-or-nothing decisions for an optimizer (see the module docstring).

    `check(grads, fused) -> bool` is the finite check (injected so that the gate's
    bookkeeping is testable without MXNet kernels).
    """

    def __init__(self, fused=None, check=all_finite):
        self.fused = fused
        self.check = check
        self._delivered = set()   # keys of this step
        self._expected = set()    # keys of the previous step
        self._awaiting = set()    # keys whose state was created but not yet delivered
        self._pending = []        # calls held back: (grads, call)
        self._checked = set()     # handles of the gradients the decision covered
        self._complete = False    # the decision covered the whole step (Gluon)
        self._boundary = False
        self._fresh = None        # every gradient of the step (Gluon), from new_step()
        self.skip = None          # None: this step is not decided yet
        self._reported = False    # whether a skipped step was handed to `take_skip`
        self.loss_scale = 1.0     # the loss scale the decided step's gradients carry
        self._decision = None     # (skip, checked gradients, calls) until `take_decision`

    def created(self, key):
        self._awaiting.add(key)

    def new_step(self, fresh=None):
        """The next call starts a step; `fresh` lists all of its gradients when the caller
        knows them (a gluon Trainer)."""
        self._boundary = True
        self._fresh = fresh

    def submit(self, keys, grads, call, scaler, scale):
        """Returns the calls to run now as (call, apply) pairs, in submission order.
        `scaler` is updated once per step, when the step is decided; `scale` (what the
        gradients carry) is kept in ``self.loss_scale`` then."""
        runs = []
        if self._boundary or any(k in self._delivered for k in keys):
            fresh = self._fresh if self._boundary else None
            runs = self._end_step(scaler)
            self._fresh = fresh
        self._delivered.update(keys)
        self._awaiting.difference_update(keys)
        self._pending.append((grads, call))
        if self.skip is None and self._fresh is None and (
                self._awaiting or not self._expected <= self._delivered):
            return runs
        if self.skip is None:
            self.loss_scale = scale
        return runs + self._release(scaler)

    def take_skip(self):
        """True once per skipped step, for whoever accounts it."""
        if self.skip and not self._reported:
            self._reported = True
            return True
        return False

    def take_decision(self):
        """(skip, the gradients checked, the calls decided with them) once per decided step,
        else None: what an overflow report needs, kept by reference (no copy, no read)."""
        decision, self._decision = self._decision, None
        return decision

    def _end_step(self, scaler):
        runs = []
        if self._pending:
            warnings.warn('a step delivered fewer parameters than the one before; its '
                          'updates ran late, at the start of the next step', RuntimeWarning)
            runs = self._release(scaler)
        self._expected = self._delivered or self._expected
        self._delivered, self._checked = set(), set()
        self.skip, self._reported, self._boundary, self._complete = None, False, False, False
        self._fresh = None
        return runs

    def _release(self, scaler):
        ready, self._pending = self._pending, []
        if self.skip is None:
            if self._fresh is not None:
                self._complete = True
                grads = self._fresh
            else:
                seen = {}
                for g in (g for grads, _ in ready for g in grads):
                    seen.setdefault(_handle(g), g)
                self._checked = set(seen)
                grads = list(seen.values())
            self.skip = not decide(scaler, grads, self.fused, self.check)
            self._decision = (self.skip, grads, [c for _, c in ready])
            return [(c, not self.skip) for _, c in ready]
        runs = []
        for grads, c in ready:
            apply_ = not self.skip
            if apply_ and not self._complete and scaler.enabled:
                unchecked = [g for g in grads if _handle(g) not in self._checked]
                if unchecked and not self.check(unchecked, self.fused):
                    warnings.warn('a gradient that the step-level overflow check could not '
                                  'see overflowed after other parameters of this step were '
                                  'updated; this step was only partly skipped',
                                  RuntimeWarning)
                    apply_ = False
            runs.append((c, apply_))
        return runs
