"""The update pipeline: the optimizer shell (`PipelineOptimizer`) over its pieces, each with
one job: accumulation (`window`), global-norm clipping (`clip`), warmup (`warmup`), the
trust ratio (`trust_ratio`), the lr's gain with the batch (`lr_scaling`, measured by
`noise_probe`, applied per update by `lr_gain`, fed by `gain_feeds`), the goodput-chosen
window (`batch_choice`), running a step's calls (`apply`, over the values of `step`) and
the optimizer's side of the step protocol with a gluon Trainer (`protocol`; the Trainer's
side is `mx_lbsgd.gluon.binding`)."""
from .batch_choice import BatchChoice, BatchChoiceState
from .clip import CLIP_EPS, GlobalNormClip
from .lr_scaling import LrScaling, LrScalingState
from .plan import SliceNorms
from .shell import PipelineOptimizer
from .trust_ratio import DEFAULT_LARS_EXCLUDE, TrustRatio
from .warmup import Warmup

__all__ = ['PipelineOptimizer', 'TrustRatio', 'DEFAULT_LARS_EXCLUDE', 'Warmup', 'GlobalNormClip',
           'CLIP_EPS', 'LrScaling', 'LrScalingState', 'BatchChoice', 'BatchChoiceState',
           'SliceNorms']
