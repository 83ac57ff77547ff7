"""The update pipeline: the optimizer shell (`PipelineOptimizer`) over its pieces, each with
one job: accumulation (`window`), warmup (`warmup`), the trust ratio (`trust_ratio`) and the
step protocol with a gluon Trainer (`binding`)."""
from .shell import PipelineOptimizer
from .trust_ratio import DEFAULT_LARS_EXCLUDE, TrustRatio
from .warmup import Warmup

__all__ = ['PipelineOptimizer', 'TrustRatio', 'DEFAULT_LARS_EXCLUDE', 'Warmup']
