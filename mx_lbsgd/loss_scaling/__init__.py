"""Loss scaling: the scaler (`DynamicLossScaler`), the step gate that decides once per step
for the optimizers (`StepGate`), the graph op for Module (`scale_gradient`) and the
overflow reports (`OverflowReport`). The hook for any gluon Trainer (`mx_lbsgd.LossScaling`)
is built on them in `mx_lbsgd.gluon`."""
from .gate import StepGate, decide, refuse_kvstore_updates, unscale_factor
from .graph import scale_gradient
from .overflow import LossScaleFallingWarning, OverflowMonitor, OverflowReport, OverflowViews
from .scaler import DynamicLossScaler, LossScaleStuckError, as_scaler

__all__ = ['DynamicLossScaler', 'LossScaleStuckError', 'as_scaler', 'StepGate',
           'decide', 'refuse_kvstore_updates', 'unscale_factor',
           'scale_gradient', 'OverflowReport', 'LossScaleFallingWarning', 'OverflowMonitor',
           'OverflowViews']
