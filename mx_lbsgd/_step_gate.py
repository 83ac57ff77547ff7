"""Kept so that files written by mx_lbsgd 0.1, whose pickled optimizers hold a
``mx_lbsgd._step_gate._StepGate``, unpickle. The optimizer replaces it when it is
unpickled (`LBSGD.__setstate__`); nothing uses it."""


class _StepGate:
    """Placeholder for 0.1's gate: accepts its pickled attributes and does nothing."""
