"""`ShardedTrainer`: optimizer state sharded over Horovod ranks in even slices (ZeRO-1).

The trained parameters of each dtype lie in one flat buffer (`mx_lbsgd.distributed.slices`:
index order, padded to a multiple of ``ranks * 16`` elements); rank r owns the r-th
contiguous slice. A tensor may cross slice boundaries, so each rank holds *pieces*: the
parts of the tensors its slice covers. Once per update::

    reduce:  reduce-scatter (sum) of each dtype's gradient buffer: rank r receives the
             reduced values of its own slice
    norm:    with a loss scaler or clipping, one allreduce of a (1,) sum of squares over
             the received slices: the global finite check and the clipping norm
    update:  the optimizer runs on this rank's pieces; the pieces of a tensor that crosses
             a boundary get its whole norms (LARS's |w| and |g|, LAMB's |w| and |d|) from
             one allreduce of a small vector per dtype, between the two phases
    gather:  allgather of each dtype's updated weight slices into the weight buffer

The gradients and weights of every parameter are views of the flat buffers, so nothing is
copied in or out. Per rank the reduce-scatter and the allgather each send (N - 1) / N of
the buffer: together what ``hvd.DistributedTrainer``'s ring allreduce sends
(`exchange_bytes`). Each rank keeps the optimizer state (fp32 master copies, moments,
momentum) of its pieces only: an even split, whatever the largest tensor.

Horovod 0.28.1's MXNet ``broadcast`` and ``alltoall`` read a freed string on MXNet's engine
thread when the collective completes before they return (`mx_lbsgd.distributed.collectives`
says how); this Trainer uses only reduce-scatter, allgather and allreduce, which build their
log line before they enqueue. The reduce-scatter and allgather are Horovod's C functions
with preallocated outputs (`mx_lbsgd._compat`): asynchronous, no host wait.

With ``batch_scale > 1`` each rank sums its own micro-batches locally (fp32 accumulators
for every parameter, ``accumulator_bytes``), and the window's mean is reduced once.
`save_states` writes one consolidated file on rank 0, in `mx_lbsgd.checkpoint`'s format,
which an unsharded Trainer, a single process or a ShardedTrainer at any world size loads.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import mxnet as mx
from mxnet import nd

from .. import _compat, _kernels, checkpoint
from ..pipeline import SliceNorms
from . import shard_states
from .slices import SliceLayout, slice_layouts

__all__ = ['ShardedTrainer']

#: MXNet's own optimizers with a per-layer ratio (they would compute it from a piece; and
#: its LBSGD with warmup_strategy='lars')
_PER_LAYER = ('LAMB', 'LARS', 'LANS')


def _horovod() -> Any:
    try:
        import horovod.mxnet as hvd
    except ImportError as err:
        raise RuntimeError('ShardedTrainer needs horovod built with MXNet support (%s): '
                           'scripts/install_horovod.sh' % err) from None
    if not hvd.is_initialized():
        raise RuntimeError('ShardedTrainer: horovod is not initialized; call hvd.init() '
                           'first (and run under horovodrun)')
    return hvd


@dataclasses.dataclass
class _Buffers:
    """One dtype's flat buffers on this rank, and the arrays of its pieces' update."""

    layout: SliceLayout
    weights: nd.NDArray              # (padded,): every parameter's weight is a view
    grads: nd.NDArray                # (padded,): every parameter's gradient is a view
    received: nd.NDArray             # (shard,): this rank's slice of the reduced gradients
    send: nd.NDArray                 # (shard,): its updated weights, the allgather's input
    index: List[int]                 # this rank's pieces, by Trainer index
    weight_views: List[nd.NDArray]   # their weights (the parameter's own for a whole one)
    grad_views: List[nd.NDArray]     # their slices of `received`
    slices: Optional[SliceNorms] = None

    def owned(self, rank: int) -> slice:
        return self.layout.owned(rank)


def _buffers(params: Sequence[Any], layout: SliceLayout, rank: int) -> _Buffers:
    """The buffers of `layout`, with every parameter of it rebound to views of them."""
    ctx = params[layout.order[0]].list_ctx()[0]
    weights = nd.zeros((layout.padded,), ctx=ctx, dtype=layout.dtype)
    grads = nd.zeros((layout.padded,), ctx=ctx, dtype=layout.dtype)
    received = nd.zeros((layout.shard,), ctx=ctx, dtype=layout.dtype)
    for i, offset, size in zip(layout.order, layout.offsets, layout.sizes):
        if size:
            shape = params[i].shape
            _compat.rebind_parameter(params[i], weights[offset:offset + size].reshape(shape),
                                     grads[offset:offset + size].reshape(shape))
    base = rank * layout.shard
    buf = _Buffers(layout=layout, weights=weights, grads=grads, received=received,
                   send=nd.zeros((layout.shard,), ctx=ctx, dtype=layout.dtype), index=[],
                   weight_views=[], grad_views=[])
    for piece in layout.pieces[rank]:
        param = params[piece.index]
        grad = received[piece.start:piece.stop]
        if piece.size == int(np.prod(param.shape)):     # the whole tensor: its own shape
            weight, grad = _compat.legacy(param.list_data()[0]), grad.reshape(param.shape)
        else:
            weight = weights[base + piece.start:base + piece.stop]
        buf.index.append(piece.index)
        buf.weight_views.append(weight)
        buf.grad_views.append(grad)
    return buf


def _slice_norms(layout: SliceLayout, rank: int, names: Sequence[str],
                 applies: Optional[Callable[[str], bool]],
                 combine: Callable[[nd.NDArray], nd.NDArray]) -> Optional[SliceNorms]:
    """The `SliceNorms` of `layout` when one of its split tensors has a per-layer ratio
    (the same answer on every rank), else None."""
    split = [i for i in layout.order if layout.split(i)]
    if applies is None or not any(applies(names[i]) for i in split):
        return None
    entry = {i: e for e, i in enumerate(split)}
    return SliceNorms(slots={p.index: entry[p.index] for p in layout.pieces[rank]
                             if p.index in entry},
                      entries=len(split), combine=combine)


class _Combine:
    """`ShardedTrainer._combine` of one dtype, holding the Trainer weakly (the optimizer
    keeps it in its `Step`)."""

    def __init__(self, trainer: 'weakref.ref[ShardedTrainer]', k: int) -> None:
        self.trainer, self.k = trainer, k

    def __call__(self, vector: nd.NDArray) -> nd.NDArray:
        trainer = self.trainer()
        if trainer is None:
            raise RuntimeError('ShardedTrainer: the Trainer of these slices is gone')
        return trainer._combine(self.k, vector)


def _refuse(trainer: Any, params: Sequence[Any]) -> None:
    """What the even split cannot do, refused before anything changes."""
    sparse = [p.name for p in params if p.grad_req != 'null'
              and _compat.grad_stype(p) != 'default']
    if sparse:
        raise ValueError('ShardedTrainer: parameter(s) %s have sparse gradients; the '
                         'sharded exchange takes dense gradients only (use '
                         'hvd.DistributedTrainer for them)' % ', '.join(map(repr, sparse)))
    opt = trainer.optimizer
    mxnet_lars = type(opt).__name__ == 'LBSGD' and getattr(opt, 'warmup_strategy', '') == 'lars'
    if type(opt).__module__.startswith('mxnet') and (type(opt).__name__ in _PER_LAYER
                                                     or mxnet_lars):
        raise ValueError(
            "ShardedTrainer: MXNet's %s computes a per-layer ratio from the arrays it is "
            'given, and the even slices split tensors over ranks, so it would see a piece of '
            'a layer. '
            "Use 'lblamb' (LAMB) or 'lbsgd' with warmup_strategy='lars' (LARS), whose ratios "
            'are exact across slices, or hvd.DistributedTrainer' % type(opt).__name__)


def _has_empty_rank(layouts: Sequence[SliceLayout], size: int) -> bool:
    """Whether some rank's slices hold only padding (a model of fewer than about
    ``size * 16`` elements): that rank would have nothing to update."""
    return any(not any(layout.pieces[rank] for layout in layouts) for rank in range(size))


class ShardedTrainer(_compat.StepHookTrainer):
    """A gluon Trainer that shards the optimizer state over Horovod ranks in even slices
    (see the module docstring). Use it where you would write ``hvd.DistributedTrainer``,
    after ``hvd.init()`` and `mx_lbsgd.distributed.broadcast_parameters`::

        trainer = mx_lbsgd.ShardedTrainer(net.collect_params(), 'lblamb', dict(
            learning_rate=1e-3, batch_scale=8, multi_precision=True, max_grad_norm=1.0,
            loss_scaler=mx_lbsgd.DynamicLossScaler()))
        trainer.step(batch_size)              # per-rank batch, as DistributedTrainer

    The gradients are summed over ranks and ``rescale_grad`` carries 1 / size, as
    Horovod's DistributedTrainer does on CPU, so the updates equal its updates. One
    context per rank; dense gradients only.

    Parameters
    ----------
    params : ParameterDict or list of Parameter
        The same parameters, with the same initial values, on every rank.
    optimizer : str or mx.optimizer.Optimizer
        mx_lbsgd's (``'lbsgd'``, ``'lssgd'``, ``'lblamb'``), whose per-layer ratios,
        loss scaling, clipping and windows work across slices, or any MXNet optimizer
        with an elementwise update (``'sgd'``, ``'nag'``, ``'adam'`` ...).
    optimizer_params : dict, optional
    prefix : str, default 'sharded'
        Prefix of the names of its Horovod collectives (distinct per Trainer in one job).

    Raises
    ------
    RuntimeError
        Horovod is not installed with MXNet support, or ``hvd.init()`` was not called.
    ValueError
        Sparse gradients, MXNet's own LAMB, LARS, LANS or LBSGD with LARS (a ratio from
        the arrays it is given), a parameter on several contexts, or (once, before the
        first step) parameters that differ across ranks.

    Examples
    --------
    It needs a Horovod job (``horovodrun -np 2 python train.py``), so the lines that run
    it are skipped here. Each rank keeps the optimizer state of its slice of each dtype's
    buffer (``trainer.layouts``) and trains with the per-rank batch:

    >>> import mxnet as mx
    >>> from mxnet import gluon
    >>> import horovod.mxnet as hvd                                 # doctest: +SKIP
    >>> import mx_lbsgd
    >>> hvd.init()                                                  # doctest: +SKIP
    >>> net = gluon.nn.Dense(4, in_units=8)
    >>> net.initialize()
    >>> params = net.collect_params()
    >>> mx_lbsgd.distributed.broadcast_parameters(params)           # doctest: +SKIP
    >>> trainer = mx_lbsgd.ShardedTrainer(params, 'lblamb', {       # doctest: +SKIP
    ...     'learning_rate': 1e-3, 'batch_scale': 2, 'max_grad_norm': 1.0})
    >>> trainer.holders()                    # 2 ranks       # doctest: +SKIP
    {'dense0_weight': [0, 1], 'dense0_bias': [1]}
    >>> trainer.step(32)                     # after backward       # doctest: +SKIP
    >>> trainer.save_states('run.states')    # every rank calls it  # doctest: +SKIP
    """

    def __init__(self, params: Any, optimizer: Any,
                 optimizer_params: Optional[Dict[str, Any]] = None,
                 prefix: str = 'sharded') -> None:
        hvd = _horovod()
        super().__init__(params, optimizer, optimizer_params, kvstore=None,
                         update_on_kvstore=False)
        self._hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        _compat.set_trainer_scale(self, _compat.trainer_scale(self) / self.size)
        self._hvd_prefix = prefix
        _refuse(self, _compat.trainer_params(self))
        self._layouts: Optional[Tuple[SliceLayout, ...]] = None
        self._buffers: List[_Buffers] = []
        self._sum_sq: Optional[nd.NDArray] = None
        self._checked = False
        self._reduced = False
        self._replicated = False
        self._reductions = 0
        self._combined: Set[int] = set()
        self._accs: Dict[int, nd.NDArray] = {}
        self._whole: frozenset = frozenset()     # tensors this rank holds whole
        if all(_compat.parameter_initialized(p) for p in _compat.trainer_params(self)):
            # check, and rebind the parameters to the flat buffers now, before any forward
            # pass (a hybridized block's cached graph then only ever sees the views)
            self._prepare()

    # -- the layout -------------------------------------------------------------------
    @property
    def layouts(self) -> Tuple[SliceLayout, ...]:
        """The even slices of each dtype's buffer (the parameters must be initialized)."""
        if self._layouts is None:
            params = _compat.trainer_params(self)
            for p in params:
                if any(d == 0 for d in p.shape):
                    raise RuntimeError('ShardedTrainer: parameter %r has an unknown shape %s;'
                                       ' run a forward pass first' % (p.name, p.shape))
            self._layouts = slice_layouts(
                [(i, int(np.prod(p.shape)), np.dtype(p.dtype).name)
                 for i, p in enumerate(params) if p.grad_req != 'null'], self.size)
        return self._layouts

    def holders(self) -> Dict[str, List[int]]:
        """{parameter name: the ranks whose slices hold a piece of it} (trained ones)."""
        params = _compat.trainer_params(self)
        self._prepare()
        return {params[i].name: (list(range(self.size)) if self._replicated else
                                 [p.rank for p in layout.pieces_of(i)])
                for layout in self.layouts for i in layout.order}

    def _prepare(self) -> None:
        if not self._checked:
            _check_same_everywhere(self)
            self._checked = True
        if self._buffers or self.size == 1:
            return
        params = _compat.trainer_params(self)
        for p in params:
            if len(p.list_ctx()) != 1:
                raise ValueError('ShardedTrainer: parameter %r lives on %d contexts; use one '
                                 'context per rank' % (p.name, len(p.list_ctx())))
        layouts = self.layouts
        # too small to split: every rank keeps and updates every state, as
        # hvd.DistributedTrainer does (one allreduce, no gather)
        self._replicated = _has_empty_rank(layouts, self.size)
        if self._replicated:
            layouts = slice_layouts([(i, l.sizes[k], l.dtype) for l in layouts
                                     for k, i in enumerate(l.order)], 1)
        applies = getattr(self.optimizer, 'trust_ratio_applies', None)
        names = [p.name for p in params]
        for k, layout in enumerate(layouts):
            buf = _buffers(params, layout, 0 if self._replicated else self.rank)
            if not self._replicated:
                buf.slices = _slice_norms(layout, self.rank, names, applies,
                                          _Combine(weakref.ref(self), k))
            self._buffers.append(buf)
            self._whole |= {p.index for p in layout.pieces[0 if self._replicated else self.rank]
                            if p.size == layout.sizes[layout.order.index(p.index)]}

    def step(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        self._prepare()        # before the window at the Trainer sums the first micro-batch
        super().step(batch_size, ignore_stale_grad)

    def allreduce_grads(self) -> None:
        self._prepare()
        super().allreduce_grads()

    # -- the exchange -----------------------------------------------------------------
    def _reduce_gradients(self) -> None:
        """The reduction of ``step`` (gluon's ``_allreduce_grads``, through
        `_compat.StepHookTrainer`)."""
        self._prepare()
        self._sum_sq = None
        if self.size == 1:
            return
        for k, buf in enumerate(self._buffers):
            name = '%s.grad.%d' % (self._hvd_prefix, k)
            if self._replicated:
                self._hvd.allreduce_(buf.grads, average=False, name=name)
            else:
                _compat.horovod_reducescatter_into(buf.grads, buf.received, name)
        self._reduced, self._combined = True, set()
        self._reductions += 1
        if getattr(self.optimizer, 'wants_step_gradients', lambda: False)():
            self._sum_sq = self._global_sum_of_squares()

    def _combine(self, k: int, vector: nd.NDArray) -> nd.NDArray:
        """The sum over ranks of dtype `k`'s vector of split tensors' partial sums."""
        self._combined.add(k)
        # named per reduction: a rank with no piece to update sends zeros that depend on
        # nothing, and may reach the next step's while the others finish this one (two
        # in-flight collectives of one name are an error in Horovod)
        return self._hvd.allreduce_(vector, average=False, name='%s.norms.%d.%d' % (
            self._hvd_prefix, k, self._reductions))

    def step_slice_norms(self) -> Optional[Dict[str, SliceNorms]]:
        """{dtype name: `pipeline.SliceNorms`} of the dtypes with a split tensor that has
        a per-layer ratio, or None (`mx_lbsgd.gluon.binding` hands it to the optimizer)."""
        slices = {b.layout.dtype: b.slices for b in self._buffers if b.slices is not None}
        return slices or None

    def reduced_sum_of_squares(self) -> nd.NDArray:
        """The sum of squares of this step's reduced gradients over every rank's slice, a
        (1,) device array (one small allreduce, unless the step already made it)."""
        if self._sum_sq is None:
            self._sum_sq = self._global_sum_of_squares()
        return self._sum_sq

    def _global_sum_of_squares(self) -> nd.NDArray:
        if self._unsplit():       # every gradient here, reduced
            return _kernels.total_sum_squares(
                [_compat.legacy(p.list_grad()[0]) for p in _compat.trainer_params(self)
                 if p.grad_req != 'null'])
        local = _kernels.total_sum_squares([b.received for b in self._buffers])
        return self._hvd.allreduce(local, average=False, name='%s.sumsq' % self._hvd_prefix)

    def step_sum_of_squares(self) -> Optional[nd.NDArray]:
        """The sum of squares of this step's reduced gradients over every rank's slice (a
        (1,) device array), or None when the optimizer does not need it."""
        return self._sum_sq

    def _update_weights(self, ignore_stale_grad: bool = False) -> None:
        """The update of ``step`` (gluon's ``_update``, through
        `_compat.StepHookTrainer`): this rank's pieces only."""
        updates = _fresh_updates(self, ignore_stale_grad)
        if updates:
            index, grads, weights = zip(*updates)
            _compat.trainer_updaters(self)[0](list(index), list(grads), list(weights))
        reduced, self._reduced = self._reduced, False
        for k, buf in enumerate(self._buffers):
            # every rank sums each vector once per reduction, this one with zeros when the
            # optimizer had none of it to update (or skipped the step)
            if reduced and buf.slices is not None and k not in self._combined:
                buf.slices.nothing(buf.received.context)
        if reduced and not self._replicated:
            self._gather_weights()     # every rank, applied or skipped (the same weights)

    def _gather_weights(self) -> None:
        for k, buf in enumerate(self._buffers):
            buf.weights[buf.owned(self.rank)].copyto(buf.send)
            _compat.horovod_allgather_into(buf.send, buf.weights,
                                           '%s.weight.%d' % (self._hvd_prefix, k))

    def exchange_bytes(self) -> Dict[str, int]:
        """Bytes this rank sends per update in ring algorithms: ``reduce`` (the gradients'
        reduce-scatter), ``gather`` (the weights' allgather), ``norm`` (the sum of squares
        and the split tensors' norms), and ``ring_allreduce`` (what a ring allreduce of
        the gradients sends per rank, as ``hvd.DistributedTrainer`` does)."""
        self._prepare()
        return _exchange_bytes(self)

    # -- windows, memory --------------------------------------------------------------
    def window_accumulator(self, index: int, weight: nd.NDArray) -> Optional[nd.NDArray]:
        """The fp32 accumulator of parameter `index` for a window at this Trainer: the
        optimizer state's for a tensor this rank holds whole, one of this Trainer's
        otherwise (each rank sums its own micro-batches of every parameter before the one
        exchange)."""
        if self._unsplit() or index in self._whole:
            state = _compat.updater_state(_compat.trainer_updaters(self)[0], index, weight)
            return self.optimizer.split_state(weight, state)[2]
        acc = self._accs.get(index)
        if acc is None:
            acc = self._accs[index] = nd.zeros(weight.shape, weight.context, dtype='float32')
        return acc

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: fp32 master copies, moments and
        momentum of its pieces (the window's accumulators are apart)."""
        return _bytes_held(self)[0]

    def accumulator_bytes(self) -> int:
        """Bytes of the window's fp32 accumulators on this rank (every parameter's: each
        rank sums its own micro-batches before the one exchange)."""
        return _bytes_held(self)[1]

    # -- checkpoints ------------------------------------------------------------------
    def save_states(self, fname: str) -> None:
        """Write one consolidated states file on rank 0 (`mx_lbsgd.checkpoint`'s format:
        atomic, checksummed, loaded without running code), which any world size, an
        unsharded Trainer or a single process loads. Every rank must call it. Refused
        inside an accumulation window (each rank then holds its own partial sums)."""
        opt = self.optimizer
        position = getattr(opt, 'window_position', 0)
        if position:
            raise ValueError('ShardedTrainer.save_states: %d micro-batches of an '
                             'accumulation window (batch_scale=%d) are summed on each rank; '
                             'save at a window boundary' % (position, opt.batch_scale))
        self._prepare()
        if self._unsplit():             # every rank holds every state
            if self.rank == 0:
                checkpoint.save_states(self, fname)
            self._saved()
            return
        updater = _compat.trainer_updaters(self)[0]
        mine = updater.states
        params = _compat.trainer_params(self)
        whole = shard_states.consolidate(
            self.layouts, self.rank, updater.states, {i: p.shape for i, p in enumerate(params)},
            lambda piece: _piece_weight(self, piece.index), opt.create_state_multi_precision,
            _compat.horovod_allgather_into, '%s.state' % self._hvd_prefix,
            self._buffers[0].received.context)
        for index in updater.states:      # created for the save: as the Updater would
            updater.states_synced.setdefault(index, True)
        counts = _fill_counts(opt, [i for i, p in enumerate(params) if p.grad_req != 'null'])
        try:
            updater.states = whole
            if self.rank == 0:
                checkpoint.save_states(self, fname)
        finally:
            updater.states = mine
            _compat.set_update_counts(opt, counts)
        self._saved()

    def _saved(self) -> None:
        if self.size > 1:         # every rank returns once rank 0 has written the file
            self._hvd.allreduce(nd.zeros((1,)), name='%s.saved' % self._hvd_prefix).asnumpy()

    def _unsplit(self) -> bool:
        """Whether this rank holds every parameter whole (one rank, or a model too small
        to split)."""
        return self.size == 1 or self._replicated

    def load_states(self, fname: str) -> None:
        """Load a states file of this model (consolidated, unsharded, from any world size)
        on every rank, keeping the states of this rank's pieces (cut out of the whole)."""
        checkpoint.load_states(self, fname)
        self._prepare()
        if not self._unsplit():
            updater = _compat.trainer_updaters(self)[0]
            sizes = {i: int(np.prod(p.shape))
                     for i, p in enumerate(_compat.trainer_params(self))}
            updater.states = shard_states.pieces_of(self.layouts, self.rank, updater.states,
                                                    sizes)
            updater.states_synced = dict.fromkeys(updater.states, False)


def _exchange_bytes(trainer: ShardedTrainer) -> Dict[str, int]:
    """`ShardedTrainer.exchange_bytes` of this rank."""
    n = trainer.size
    reduce_ = total = 0
    norm = 4
    for buf in trainer._buffers:
        item = np.dtype(buf.layout.dtype).itemsize
        reduce_ += (n - 1) * buf.layout.shard * item
        total += buf.layout.total * item
        norm += 0 if buf.slices is None else 8 * buf.slices.entries
    ring = 2 * (n - 1) / n if n > 1 else 0.0
    gather = reduce_
    if trainer._replicated:      # one ring allreduce of the gradients, no gather
        reduce_, gather = int(ring * total), 0
    return {'reduce': reduce_, 'gather': gather, 'norm': int(ring * norm),
            'ring_allreduce': int(ring * total)}


def _piece_weight(trainer: ShardedTrainer, index: int) -> nd.NDArray:
    """The weight array this rank's update passes for its piece of parameter `index`."""
    for buf in trainer._buffers:
        if index in buf.index:
            return buf.weight_views[buf.index.index(index)]
    raise KeyError(index)


def _fresh_updates(trainer: ShardedTrainer, ignore_stale_grad: bool
                   ) -> List[Tuple[int, nd.NDArray, nd.NDArray]]:
    """(index, gradient, weight) of this rank's pieces (every parameter with one rank) to
    update, after gluon's stale-gradient check; every gradient is marked used."""
    params = _compat.trainer_params(trainer)
    if trainer._unsplit():
        candidates = [(i, _compat.legacy(p.list_grad()[0]), _compat.legacy(p.list_data()[0]))
                      for i, p in enumerate(params) if p.grad_req != 'null']
    else:
        candidates = [c for buf in trainer._buffers
                      for c in zip(buf.index, buf.grad_views, buf.weight_views)]
    updates = []
    for i, grad, weight in candidates:
        data = params[i].list_data()[0]
        fresh = _compat.is_fresh(data)
        if not fresh and not ignore_stale_grad:
            raise UserWarning('Gradient of Parameter `%s` on context %s has not been '
                              'updated by backward since last `step`' % (
                                  params[i].name, data.context))
        if fresh or not ignore_stale_grad:
            updates.append((i, grad, weight))
    _compat.clear_fresh_gradients(p for p in params if p.grad_req != 'null')
    return updates


def _check_same_everywhere(trainer: ShardedTrainer) -> None:
    """Once: every rank holds the same initial parameters (a digest per parameter,
    allgathered and compared)."""
    params = _compat.trainer_params(trainer)
    digest = nd.concat(*[nd.sum(nd.abs(p.list_data()[0].astype('float64'))).reshape((1,))
                         for p in params], dim=0).reshape((1, -1))
    everyone = trainer._hvd.allgather(digest, name='%s.check' % trainer._hvd_prefix).asnumpy()
    for k, p in enumerate(params):
        if not np.all(everyone[:, k] == everyone[0, k]):
            raise ValueError(
                'ShardedTrainer: parameter %r differs across ranks (sum of |w| per rank: '
                '%s); broadcast the parameters first: '
                'mx_lbsgd.distributed.broadcast_parameters(params, root_rank=0)'
                % (p.name, everyone[:, k].tolist()))


def _bytes_held(trainer: ShardedTrainer) -> Tuple[int, int]:
    """(optimizer state bytes, window accumulator bytes) on this rank."""
    state = 0
    accs = sum(a.size * 4 for a in trainer._accs.values())
    split = getattr(trainer.optimizer, 'split_state', None)
    params = _compat.trainer_params(trainer)
    for i, held in _compat.trainer_updaters(trainer)[0].states.items():
        weight = (params[i].list_data()[0] if trainer._unsplit()
                  else _piece_weight(trainer, i))
        if split is not None:
            family, master, acc = split(weight, held)
            held = (family, master)
            accs += 0 if acc is None else acc.size * 4
        state += sum(a.size * np.dtype(a.dtype).itemsize for a in shard_states.arrays(held))
    return state, accs


def _fill_counts(opt: mx.optimizer.Optimizer, trained: Iterable[int]) -> Dict[int, Dict[Any, int]]:
    """Give every trained index the micro-batch count of the indices this rank updated
    (every parameter advances together); returns the counts as they were, to put back."""
    every, _ = _compat.update_counts(opt)
    saved = {k: dict(v) for k, v in every.items()}
    for device_counts in every.values():
        if device_counts:
            top = max(device_counts.values())
            for i in trained:
                device_counts.setdefault(i, top)
    return saved
