"""All-or-nothing overflow decisions inside an Optimizer.

MXNet's Updater calls an optimizer several times per step: once per device (Gluon keeps one
Updater per device, Module one for all) and, within a device, once per weight dtype. A skip
decided call by call could apply the float32 group and skip the float16 one. The gate
decides once per step instead, over all of the step's gradients, with one host read:

- with a gluon Trainer at the first call, over the fresh gradients of all parameters on all
  devices (listed by the optimizer's `rescale_grad` setter, which `Trainer.step` calls
  before it clears the fresh flags);
- otherwise (Module, a bare Updater) it holds calls back until the step has delivered every
  (context, index) pair the previous step delivered; in the first step, every index whose
  state the Updater just created (it creates a whole device call's states before updating
  any of them). All of this happens inside one Updater round, before the next forward.

A step ends when a (context, index) pair repeats, or at `new_step()` (the optimizer's
`rescale_grad` setter: `Trainer.step` sets it). A gradient that turns up after the decision
without having been checked (a second device in Module's first step) is checked on its own;
if it overflows while the step was applied, its group is skipped and a warning says that
the step was only partly skipped (with kvstore-reduced gradients every device agrees).
"""
import warnings

from . import _kernels


def _handle(array):
    return array.handle.value


class _StepGate:
    def __init__(self, fused):
        self.fused = fused
        self._delivered = set()   # (context, index) pairs of this step
        self._expected = set()    # the pairs of the previous step
        self._awaiting = set()    # pairs whose state was created but not yet delivered
        self._pending = []        # calls held back: (grads, call)
        self._checked = set()     # handles of the gradients the decision covered
        self._boundary = False    # new_step() was called
        self._fresh = []          # gradients of the whole step, given to new_step()
        self.skip = None          # None: this step is not decided yet
        self.counted = False      # whether a skipped step was counted in num_update
        self.scale = 1.0          # the loss scale this step's gradients carry
        self.scale_override = None

    def created(self, key):
        self._awaiting.add(key)

    def new_step(self, fresh=()):
        """Marks the next call as the start of a step; `fresh` lists all of its gradients
        when the caller knows them (a gluon Trainer, before it clears the fresh flags)."""
        self._boundary = True
        self._fresh = list(fresh)

    def submit(self, keys, grads, call, scaler):
        """Returns the calls to run now as (call, apply) pairs, in submission order.

        `scaler` is updated once per step, when the step is decided.
        """
        runs = []
        fresh = self._fresh if self._boundary else []
        if self._boundary or any(k in self._delivered for k in keys):
            if self._pending:
                warnings.warn('a step delivered fewer parameters than the one before; its '
                              'updates ran late, at the start of the next step',
                              RuntimeWarning)
                runs = self._release(scaler, [])
            self._expected = self._delivered or self._expected
            self._delivered, self._checked = set(), set()
            self.skip, self.counted, self._boundary, self._fresh = None, False, False, []
        self._delivered.update(keys)
        self._awaiting.difference_update(keys)
        self._pending.append((grads, call))
        extra = fresh if self.skip is None else []
        if self.skip is None and not extra and (
                self._awaiting or not self._expected <= self._delivered):
            return runs
        return runs + self._release(scaler, extra)

    def _release(self, scaler, extra):
        ready, self._pending = self._pending, []
        if self.skip is None:
            self._decide([g for grads, _ in ready for g in grads] + extra, scaler)
            return [(c, not self.skip) for _, c in ready]
        runs = []
        for grads, c in ready:
            unchecked = [g for g in grads if _handle(g) not in self._checked]
            apply_ = not self.skip
            if unchecked and apply_ and not self._finite(unchecked):
                warnings.warn('a gradient that the step-level overflow check could not see '
                              'overflowed after other parameters of this step were updated; '
                              'this step was only partly skipped', RuntimeWarning)
                apply_ = False
            runs.append((c, apply_))
        return runs

    def _decide(self, grads, scaler):
        self.scale = self.scale_override or scaler.scale
        self.scale_override = None
        if not scaler.enabled:
            self.skip = False
            return
        seen = {}
        for g in grads:
            seen.setdefault(_handle(g), g)
        self._checked = set(seen)
        self.skip = not scaler.update(not self._finite(list(seen.values())))

    def _finite(self, grads):
        return bool(_kernels.all_finite(grads, self.fused).asscalar())
