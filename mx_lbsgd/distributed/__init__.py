"""Scale-out: the parameter-server launcher (`mx_lbsgd.distributed.launch`), the drain that
keeps Horovod jobs from crashing at exit (`mx_lbsgd.distributed.horovod_exit`), and
broadcasts that avoid Horovod 0.28.1's MXNet broadcast (`mx_lbsgd.distributed.collectives`:
use `broadcast_parameters` where you would call ``hvd.broadcast_parameters``)."""
from . import horovod_exit  # noqa: F401  (registers the exit drain with _compat)
from .collectives import broadcast_parameters

__all__ = ['broadcast_parameters']
