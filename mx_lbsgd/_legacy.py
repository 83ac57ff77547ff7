"""Loading what earlier versions of mx_lbsgd wrote: the one place that knows their formats.

- mx_lbsgd 0.1 ended every optimizer state with a `Ledger` (a reference to its optimizer,
  pickled as ``mx_lbsgd.lbsgd._Ledger``) and pickled its optimizers with a ``_gate`` of
  class ``mx_lbsgd._step_gate._StepGate`` and a few attributes of its own;
- later versions pickled the per-step attributes ``window_phase``/``window_position`` and a
  ``_kvstore_refusal`` flag, and lacked ``lazy_update`` and ``lars``
  (and ``nesterov``, read as False).

`checkpoint.load_states` converts such files (`strip_ledgers`); the optimizers' own
``__setstate__`` calls `upgrade_optimizer_state`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Tuple

if TYPE_CHECKING:
    import mxnet as mx

LEDGER_IN_STATE = (
    'these optimizer states were written by mx_lbsgd 0.1 (each state ends with its '
    'optimizer); load the file with mx_lbsgd.checkpoint.load_states(target, path), which '
    "converts it to MXNet's layout and keeps the counters")


class Ledger:
    """The last element of every state written by mx_lbsgd 0.1: a reference to its
    optimizer. Kept so that such files unpickle."""

    def __init__(self, opt: mx.optimizer.Optimizer | None = None) -> None:
        self.opt = opt


# pickled under 0.1's name, as 0.1 did (tests write such files; `lbsgd` keeps the alias)
Ledger.__module__, Ledger.__qualname__ = 'mx_lbsgd.lbsgd', '_Ledger'


class _StepGatePlaceholder:
    """Stands in for 0.1's ``_step_gate._StepGate``: takes its pickled attributes."""


#: (module, name) pickled by earlier versions -> the class that reads it now
GLOBALS: Dict[Tuple[str, str], type] = {
    ('mx_lbsgd.lbsgd', '_Ledger'): Ledger,
    ('mx_lbsgd._step_gate', '_StepGate'): _StepGatePlaceholder}

_DROPPED = ('_ledger', '_token', '_adopted', '_gate', '_scratch', '_plans', 'window_phase',
            'window_position', '_kvstore_refusal', '_checked_trainer')


def upgrade_optimizer_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer's pickled ``__dict__`` from any earlier version, in today's form."""
    state = {k: v for k, v in state.items() if k not in _DROPPED}
    state.setdefault('lazy_update', True)
    if 'warmup_strategy' in state:
        state.setdefault('lars', state['warmup_strategy'] == 'lars')
        state.setdefault('nesterov', False)
    return state


def strip_ledgers(states: Mapping[Any, Any],
                  progress_of: Callable[[Any], dict[str, Any]]
                  ) -> tuple[dict[Any, Any], dict[str, Any] | None]:
    """0.1 states without their ledgers, and the progress (`progress_of(optimizer)`) of the
    first ledger's optimizer (None when no state has a ledger)."""
    progress = None
    clean = {}
    for key, state in states.items():
        if isinstance(state, tuple) and state and isinstance(state[-1], Ledger):
            if progress is None and state[-1].opt is not None:
                progress = progress_of(state[-1].opt)
            state = state[:-1]
            state = state[0] if len(state) == 1 else state
        clean[key] = state
    return clean, progress
