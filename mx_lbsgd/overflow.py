"""`mx_lbsgd.overflow` is `mx_lbsgd.loss_scaling.overflow`, the overflow reports. The path
stays for imports."""
import sys

from .loss_scaling import overflow as _module

sys.modules[__name__] = _module
