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
  is checked on its own and, if it overflows, its group is skipped with a warning. After a
  decided step, a call on devices that none of the keys so far were on (the optimizer moved
  on to a Module bound elsewhere) begins a step as the first round does.
"""
from __future__ import annotations

import warnings
from typing import (TYPE_CHECKING, Any, Callable, Dict, Generic, List, NoReturn, Optional,
                    Sequence, Set, Tuple, TypeVar)

from mxnet import nd

from .. import _compat, _kernels

if TYPE_CHECKING:
    from .scaler import DynamicLossScaler

#: the finite check: (gradients, fused) -> whether every element is finite
Check = Callable[[Sequence[nd.NDArray], Optional[bool]], bool]
#: a call's (context, index) key
Key = Tuple[Any, Any]
#: what a caller submits as a call (the optimizer shell: an Updater call's lists)
C = TypeVar('C')
#: a call to run, and whether it applies (False: its step is skipped)
Run = Tuple[C, bool]

_KVSTORE_REFUSAL = (
    '%s cannot run with update_on_kvstore=True: the kvstore updates each parameter as soon '
    'as its gradient arrives, so an overflow step cannot be skipped as a whole. Use '
    'gluon.Trainer(..., update_on_kvstore=False), or for Module set the environment '
    'variable MXNET_UPDATE_ON_KVSTORE=0')


def refuse_kvstore_updates(owner: str) -> NoReturn:
    """Raise the one refusal of loss scaling on a kvstore that updates the weights.
    `owner` names who refuses (an optimizer class name, or 'LossScaling').

    Parameters
    ----------
    owner : str

    Raises
    ------
    ValueError
        Always: the message says why and what to use instead.

    Examples
    --------
    >>> from mx_lbsgd.loss_scaling import refuse_kvstore_updates
    >>> refuse_kvstore_updates('LossScaling')
    Traceback (most recent call last):
    ...
    ValueError: LossScaling cannot run with update_on_kvstore=True: the kvstore updates ...
    """
    raise ValueError(_KVSTORE_REFUSAL % owner)


def all_finite(grads: Sequence[nd.NDArray], fused: Optional[bool]) -> bool:
    """True when every element of every gradient is finite (one host read)."""
    return _kernels.all_finite_now(grads, fused)


def decide(scaler: DynamicLossScaler, grads: Sequence[nd.NDArray], fused: Optional[bool],
           check: Check = all_finite) -> bool:
    """One loss-scaling step: check `grads`, account the result in `scaler` (grow, back
    off, count). Returns True when the step is to be applied.

    Parameters
    ----------
    scaler : DynamicLossScaler
        Updated once (nothing happens when it is disabled).
    grads : sequence of NDArray
        Every gradient of the step, on any devices.
    fused : None or bool
        Kernel path of the finite check (see ``LBSGD(fused=...)``).
    check : callable(grads, fused) -> bool, optional
        The finite check; the default runs it on the devices and reads one flag back.

    Returns
    -------
    bool
        True to apply the step, False to skip it.

    Examples
    --------
    >>> from mxnet import nd
    >>> from mx_lbsgd import DynamicLossScaler
    >>> from mx_lbsgd.loss_scaling import decide
    >>> scaler = DynamicLossScaler(init_scale=8.0)
    >>> decide(scaler, [nd.array([1.0, 2.0]), nd.array([float('nan')])], None)
    False
    >>> scaler.scale
    4.0
    >>> decide(scaler, [nd.array([1.0, 2.0])], None)
    True
    """
    if not scaler.enabled:
        return True
    return scaler.update(not check(grads, fused))


def unscale_factor(scale: float) -> float:
    """The factor folded into the update's ``rescale_grad`` for gradients carrying `scale`.

    Parameters
    ----------
    scale : float > 0

    Returns
    -------
    float
        ``1 / scale``.

    Examples
    --------
    >>> from mx_lbsgd.loss_scaling import unscale_factor
    >>> unscale_factor(1024.0)
    0.0009765625
    """
    return 1.0 / scale


def _handle(array: nd.NDArray) -> int:
    return _compat.buffer_id(array)


class StepGate(Generic[C]):
    """Step-level all-or-nothing decisions for an optimizer (see the module docstring).

    `check(grads, fused) -> bool` is the finite check (injected so that the gate's
    bookkeeping is testable without MXNet kernels).

    Parameters
    ----------
    fused : None or bool
        Kernel path of the finite check.
    check : callable(grads, fused) -> bool, optional
        The finite check (default: on the device, one host read).

    Examples
    --------
    A Gluon-style step: `new_step` lists every gradient of the step, so the first call
    decides for all of them (here: skip, and the scale backs off).

    >>> import mxnet as mx
    >>> from mxnet import nd
    >>> from mx_lbsgd import DynamicLossScaler
    >>> from mx_lbsgd.loss_scaling import StepGate
    >>> scaler = DynamicLossScaler(init_scale=8.0)
    >>> gate = StepGate()
    >>> grad = nd.array([1.0, float('inf')])
    >>> gate.new_step([grad])
    >>> gate.submit([(mx.cpu(), 0)], [grad], 'update 0', scaler, scaler.scale)
    [('update 0', False)]
    >>> gate.take_skip(), gate.take_skip(), scaler.scale   # reported once
    (True, False, 4.0)

    The next step, announced without its gradients (as Module's Updater rounds are found):
    it is decided once every key of the previous step has arrived.

    >>> gate.new_step()
    >>> gate.submit([(mx.cpu(), 0)], [nd.array([1.0, 2.0])], 'update 1', scaler, 4.0)
    [('update 1', True)]
    """

    def __init__(self, fused: Optional[bool] = None, check: Check = all_finite) -> None:
        self.fused = fused
        self.check = check
        self._delivered: Set[Key] = set()   # keys of this step
        self._expected: Set[Key] = set()    # keys of the previous step
        self._awaiting: Set[Key] = set()    # keys whose state was created but not yet delivered
        # calls held back: (grads, call)
        self._pending: List[Tuple[Sequence[nd.NDArray], C]] = []
        self._checked: Set[int] = set()       # handles of the gradients the decision covered
        self._complete = False    # the decision covered the whole step (Gluon)
        self._boundary = False
        # every gradient of the step (Gluon), from new_step()
        self._fresh: Optional[Sequence[nd.NDArray]] = None
        self.skip: Optional[bool] = None    # None: this step is not decided yet
        self._reported = False    # whether a skipped step was handed to `take_skip`
        self.loss_scale = 1.0     # the loss scale the decided step's gradients carry
        # (skip, checked gradients, calls) until `take_decision`
        self._decision: Optional[Tuple[bool, Sequence[nd.NDArray], List[C]]] = None

    def created(self, key: Key) -> None:
        self._awaiting.add(key)

    def new_step(self, fresh: Optional[Sequence[nd.NDArray]] = None) -> None:
        """The next call starts a step; `fresh` lists all of its gradients when the caller
        knows them (a gluon Trainer)."""
        self._boundary = True
        self._fresh = fresh

    def submit(self, keys: Sequence[Key], grads: Sequence[nd.NDArray], call: C,
               scaler: DynamicLossScaler, scale: float) -> List[Run[C]]:
        """Returns the calls to run now as (call, apply) pairs, in submission order.
        `scaler` is updated once per step, when the step is decided; `scale` (what the
        gradients carry) is kept in ``self.loss_scale`` then."""
        runs: List[Run[C]] = []
        if self._boundary or any(k in self._delivered for k in keys):
            fresh = self._fresh if self._boundary else None
            runs = self._end_step(scaler)
            self._fresh = fresh
        elif (self.skip is not None and not self._pending and self._expected
              and not {c for c, _ in self._expected | self._delivered} & {c for c, _ in keys}):
            # after a decided step, a call on devices no key so far was on (an optimizer
            # moved on to a Module bound elsewhere) begins a step whose keys are learned as in
            # the first round, instead of a late part of the decided step
            runs = self._end_step(scaler)
            self._expected = set()
        self._delivered.update(keys)
        self._awaiting.difference_update(keys)
        self._pending.append((grads, call))
        if self.skip is None and self._fresh is None and (
                self._awaiting or not self._expected <= self._delivered):
            return runs
        if self.skip is None:
            self.loss_scale = scale
        return runs + self._release(scaler)

    def take_skip(self) -> bool:
        """True once per skipped step, for whoever accounts it."""
        if self.skip and not self._reported:
            self._reported = True
            return True
        return False

    def take_decision(self) -> Optional[Tuple[bool, Sequence[nd.NDArray], List[C]]]:
        """(skip, the gradients checked, the calls decided with them) once per decided step,
        else None: what an overflow report needs, kept by reference (no copy, no read)."""
        decision, self._decision = self._decision, None
        return decision

    def _end_step(self, scaler: DynamicLossScaler) -> List[Run[C]]:
        runs: List[Run[C]] = []
        if self._pending:
            warnings.warn('a step delivered fewer parameters than the one before; its '
                          'updates ran late, at the start of the next step', RuntimeWarning)
            runs = self._release(scaler)
        self._expected = self._delivered or self._expected
        self._delivered, self._checked = set(), set()
        self.skip, self._reported, self._boundary, self._complete = None, False, False, False
        self._fresh = None
        return runs

    def _release(self, scaler: DynamicLossScaler) -> List[Run[C]]:
        ready, self._pending = self._pending, []
        if self.skip is None:
            if self._fresh is not None:
                self._complete = True
                grads = self._fresh
            else:
                seen: Dict[int, nd.NDArray] = {}
                for g in (g for grads, _ in ready for g in grads):
                    seen.setdefault(_handle(g), g)
                self._checked = set(seen)
                grads = list(seen.values())
            self.skip = not decide(scaler, grads, self.fused, self.check)
            self._decision = (self.skip, grads, [c for _, c in ready])
            return [(c, not self.skip) for _, c in ready]
        runs: List[Run[C]] = []
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
