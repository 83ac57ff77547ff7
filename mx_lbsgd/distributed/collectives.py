"""Broadcasts over Horovod for MXNet arrays that avoid Horovod 0.28.1's broadcast.

Why: Horovod 0.28.1's MXNet binding keeps a collective's name in the parameters of the
MXNet engine operation that runs it (``horovod/mxnet/mpi_ops.cc``), and
``EnqueueTensorBroadcast`` and ``EnqueueTensorAlltoall`` (``horovod/common/operations.cc``)
stream that name into a log message *after* they put the tensor on Horovod's queue. When
Horovod's background thread finishes the collective first, it calls MXNet's completion
callback, which deletes the engine operation and the name with it; the engine thread then
reads a freed ``std::string``. That is a segfault, or garbage copied into the log stream (a
rank whose memory grows by gigabytes), or a thread stuck in that copy, which MXNet's engine
joins at exit: a job that never ends. The allreduce, allgather and reducescatter paths build
their log message before they enqueue, so they are not affected.

`broadcast_` is therefore an allreduce in which every rank but the root contributes
``-0.0`` (0 for integers): ``x + (-0.0)`` is ``x`` bit for bit for every float (``+0.0``,
``-0.0``, subnormals and inf included; a NaN stays NaN, though Horovod's float16 sum does
not keep its payload), so every rank receives the root's values, in place, with no wait.
It moves twice the bytes of a ring broadcast. ``ShardedTrainer`` and
the package's commands use it; scripts should call `broadcast_parameters` where they would
call ``hvd.broadcast_parameters``.
"""
from __future__ import annotations

from typing import Any, List, Mapping, Sequence, Union

import mxnet as mx
from mxnet import nd

__all__ = ['broadcast_', 'broadcast_parameters']

#: Horovod's grouped operations take at most this many tensors per call here (one
#: negotiation each; large groups are split to bound the size of one fused message)
_GROUP = 64


def _horovod() -> Any:
    try:
        import horovod.mxnet as hvd
    except ImportError as err:
        raise RuntimeError('mx_lbsgd.distributed.collectives needs horovod built with MXNet '
                           'support (%s): scripts/install_horovod.sh' % err) from None
    if not hvd.is_initialized():
        raise RuntimeError('horovod is not initialized; call hvd.init() first (and run '
                           'under horovodrun)')
    return hvd


def broadcast_(tensors: Union[nd.NDArray, Sequence[nd.NDArray]], root_rank: int,
               name: str) -> None:
    """Overwrite `tensors` on every rank with the root's values, in place, asynchronously
    (as ``hvd.broadcast_``), with Horovod's allreduce.

    Parameters
    ----------
    tensors : NDArray or sequence of NDArray
        The same shapes and dtypes on every rank, in the same order.
    root_rank : int
        The rank whose values every rank receives; in [0, hvd.size()).
    name : str
        The collective's name: the same on every rank, distinct from other collectives in
        flight.

    Raises
    ------
    RuntimeError
        Horovod is missing or not initialized.
    ValueError
        `root_rank` outside [0, size).

    Examples
    --------
    In a Horovod job (``horovodrun -np 2 python script.py``):

    >>> import horovod.mxnet as hvd                                # doctest: +SKIP
    >>> from mxnet import nd
    >>> from mx_lbsgd.distributed.collectives import broadcast_
    >>> hvd.init()                                                 # doctest: +SKIP
    >>> x = nd.ones((3,)) * hvd.rank()                             # doctest: +SKIP
    >>> broadcast_(x, root_rank=1, name='x')                       # doctest: +SKIP
    >>> x.asnumpy()                       # on every rank          # doctest: +SKIP
    array([1., 1., 1.], dtype=float32)
    """
    hvd = _horovod()
    arrays = [tensors] if isinstance(tensors, nd.NDArray) else list(tensors)
    if not 0 <= root_rank < hvd.size():
        raise ValueError('root_rank must be in [0, %d); got %r' % (hvd.size(), root_rank))
    if hvd.size() == 1 or not arrays:
        return
    if hvd.rank() != root_rank:
        for a in arrays:               # (a[:] = -0.0 writes +0.0)
            nd.negative(nd.zeros_like(a), out=a)
    for start in range(0, len(arrays), _GROUP):
        group = arrays[start:start + _GROUP]
        if len(group) == 1:
            hvd.allreduce_(group[0], average=False, name='%s.%d' % (name, start))
        else:
            hvd.grouped_allreduce_(group, average=False, name='%s.%d' % (name, start))


def broadcast_parameters(params: Union[Mapping[str, Any], Sequence[Any]],
                         root_rank: int = 0, prefix: str = 'mx_lbsgd.params') -> None:
    """Give every rank the root's parameters: what ``hvd.broadcast_parameters`` does,
    without Horovod 0.28.1's MXNet broadcast (see the module docstring).

    Parameters
    ----------
    params : ParameterDict, dict or list
        Gluon Parameters (``net.collect_params()``; every context of a parameter receives
        the root's values) or NDArrays (Module's ``arg_params`` / ``aux_params``), the same
        on every rank. Parameters must be initialized (no deferred shapes).
    root_rank : int, default 0
    prefix : str, default 'mx_lbsgd.params'
        The collectives' name prefix (distinct per call while another is in flight).

    Raises
    ------
    RuntimeError
        Horovod is missing or not initialized.
    ValueError
        A Parameter whose initialization is deferred, or an entry that is neither a Gluon
        Parameter nor an NDArray.

    Examples
    --------
    In a Horovod job, where you would call ``hvd.broadcast_parameters``:

    >>> import horovod.mxnet as hvd                                # doctest: +SKIP
    >>> import mxnet as mx
    >>> from mx_lbsgd.distributed import broadcast_parameters
    >>> hvd.init()                                                 # doctest: +SKIP
    >>> net = mx.gluon.nn.Dense(4, in_units=8)
    >>> net.initialize()
    >>> broadcast_parameters(net.collect_params(), root_rank=0)    # doctest: +SKIP
    """
    # a ParameterDict has items() but is no Mapping
    items = (sorted(params.items(), key=lambda kv: kv[0]) if hasattr(params, 'items')
             else list(enumerate(params)))
    sources: List[nd.NDArray] = []
    copies: List[List[nd.NDArray]] = []
    for key, value in items:
        if isinstance(value, mx.gluon.Parameter):
            try:
                arrays = value.list_data()
            except mx.gluon.parameter.DeferredInitializationError:
                raise ValueError(
                    'broadcast_parameters: parameter %r is not initialized yet (its shape is '
                    'deferred); run a forward pass first, or give in_units/in_channels'
                    % value.name) from None
        elif isinstance(value, nd.NDArray):
            arrays = [value]
        else:
            raise ValueError('broadcast_parameters: %r is a %s; expected Gluon Parameters or '
                             'NDArrays' % (key, type(value).__name__))
        sources.append(arrays[0])
        copies.append(arrays[1:])
    broadcast_(sources, root_rank, prefix)
    for source, others in zip(sources, copies):
        for other in others:
            source.copyto(other)
