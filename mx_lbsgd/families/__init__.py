"""Kernel families: an optimizer's update rule and state layout on its kernel paths
(native CPU operator, MXNet's per-tensor and multi-tensor operators, sparse)."""
from .base import FamilyBase, GradNorm, KernelFamily, KernelTrust, SparseKernelFamily
from .lamb import LAMBFamily
from .sgd import SGDFamily

__all__ = ['KernelFamily', 'SparseKernelFamily', 'FamilyBase', 'GradNorm', 'KernelTrust',
           'SGDFamily', 'LAMBFamily']
