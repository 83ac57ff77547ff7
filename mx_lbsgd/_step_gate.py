"""mx_lbsgd 0.1 pickled its optimizers with a ``_gate`` of class
``mx_lbsgd._step_gate._StepGate``: this name lets MXNet's own ``Trainer.load_states`` read
such files too (then the next step asks for ``mx_lbsgd.checkpoint.load_states``). The
knowledge of 0.1's formats lives in `_legacy`."""
from ._legacy import _StepGatePlaceholder as _StepGate  # noqa: F401
