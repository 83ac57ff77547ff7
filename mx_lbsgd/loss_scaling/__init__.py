"""Loss scaling: the scaler (`DynamicLossScaler`), the step gate that decides once per step
for the optimizers (`StepGate`), the Trainer hook (`LossScaling`), the graph
op for Module (`scale_gradient`) and the overflow reports (`OverflowReport`)."""
from .gate import StepGate, decide, refuse_kvstore_updates, unscale_factor
from .graph import scale_gradient
from .hook import LossScaling
from .overflow import LossScaleFallingWarning, OverflowMonitor, OverflowReport, OverflowViews
from .scaler import DynamicLossScaler, LossScaleStuckError, as_scaler

__all__ = ['DynamicLossScaler', 'LossScaleStuckError', 'as_scaler', 'StepGate',
           'decide', 'refuse_kvstore_updates', 'unscale_factor', 'LossScaling',
           'scale_gradient', 'OverflowReport', 'LossScaleFallingWarning', 'OverflowMonitor',
           'OverflowViews']
