"""`mx_lbsgd.loss_scale` is `mx_lbsgd.loss_scaling.scaler`, the dynamic loss-scale policy. The
path stays for imports and for files that earlier versions pickled."""
import sys

from .loss_scaling import scaler as _module

sys.modules[__name__] = _module
