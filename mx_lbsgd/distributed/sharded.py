"""`ShardedTrainer`: optimizer state sharded over Horovod ranks (ZeRO-1), whole tensors.

Each rank owns whole parameters (`Partition`: balanced by bytes, largest first), keeps the
optimizer state (fp32 master copies, moments, momentum) of those only, and updates only
those, so a trust ratio (LARS, LAMB) always sees a whole layer. Once per update::

    reduce:  one in-place allreduce (sum) per dtype of the gradients, laid out by owner
             in one flat buffer; each owner keeps the sums of its own
    norm:    with a loss scaler or clipping, one allreduce of a (1,) sum of squares over
             the owned gradients: the global finite check and the clipping norm
    update:  each owner runs the optimizer (every kernel family, the loss-scale gate,
             clipping, the window) on its parameters
    gather:  one in-place allreduce (sum) per dtype of the weights, to which every rank
             but a parameter's owner contributes -0.0: every rank receives the owners' bits

Horovod 0.28.1's MXNet ``alltoall`` and ``broadcast`` read a freed string on MXNet's engine
thread when the collective completes before they return (`mx_lbsgd.distributed.collectives`
says how), which crashed, hung or bloated sharded jobs; its allreduce does not. Both
exchanges are asynchronous and in place (no wait, no copy): each sends what a ring allreduce
of the gradients sends, 2 (N - 1) / N x the gradients per rank, so an update moves twice
``hvd.DistributedTrainer``'s bytes (`exchange_bytes` reports them). What is sharded is the
optimizer state, not the traffic.

With ``batch_scale > 1`` each rank sums its own micro-batches locally (fp32 accumulators
for every parameter, ``accumulator_bytes``), and the window's mean is reduced once.
`save_states` writes one consolidated file on rank 0, in `mx_lbsgd.checkpoint`'s format,
which an unsharded Trainer, a single process or a ShardedTrainer at any world size loads.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import mxnet as mx
from mxnet import nd

from .. import _compat, _kernels, checkpoint
from . import collectives

__all__ = ['ShardedTrainer', 'Partition', 'partition']


@dataclasses.dataclass(frozen=True)
class Partition:
    """Which rank owns which parameter (trainer index -> rank; -1: not trained).

    Made by `partition` (a frozen dataclass, the same on every rank).

    Parameters
    ----------
    names : tuple of str
        The Trainer's parameter names, in its order.
    owners : tuple of int
        The owning rank of each, -1 for a parameter that is not trained.
    nbytes : tuple of int
        The bytes of each weight.
    size : int
        The number of ranks.

    Examples
    --------
    >>> from mx_lbsgd.distributed.sharded import Partition
    >>> part = Partition(names=('w', 'b'), owners=(0, 1), nbytes=(64, 8), size=2)
    >>> part.owned(1), part.bytes_per_rank(), part.by_name()
    ([1], [64, 8], {'w': 0, 'b': 1})
    """

    names: Tuple[str, ...]
    owners: Tuple[int, ...]
    nbytes: Tuple[int, ...]
    size: int

    def owned(self, rank: int) -> List[int]:
        """The trainer indices of the parameters `rank` owns, in order."""
        return [i for i, r in enumerate(self.owners) if r == rank]

    def bytes_per_rank(self) -> List[int]:
        """Bytes of the weights each rank owns."""
        out = [0] * self.size
        for r, b in zip(self.owners, self.nbytes):
            if r >= 0:
                out[r] += b
        return out

    def by_name(self) -> Dict[str, int]:
        """{parameter name: owning rank} (trained parameters only)."""
        return {n: r for n, r in zip(self.names, self.owners) if r >= 0}


def partition(names: Sequence[str], nbytes: Sequence[int], trained: Sequence[bool],
              size: int) -> Partition:
    """Whole tensors to `size` ranks by bytes: largest first, each to the rank with the
    fewest bytes so far (ties: the lower rank); the same on every rank.

    Parameters
    ----------
    names : sequence of str
    nbytes : sequence of int
        The bytes of each weight.
    trained : sequence of bool
        False for parameters with ``grad_req='null'`` (owned by no rank: -1).
    size : int
        The number of ranks.

    Returns
    -------
    Partition

    Examples
    --------
    >>> from mx_lbsgd.distributed.sharded import partition
    >>> part = partition(['fc0_weight', 'fc0_bias', 'fc1_weight', 'fc1_bias', 'bn_mean'],
    ...                  [4096, 64, 2048, 32, 64], [True, True, True, True, False], size=2)
    >>> part.owners
    (0, 1, 1, 1, -1)
    >>> part.owned(1), part.bytes_per_rank()
    ([1, 2, 3], [4096, 2144])
    """
    loads = [0] * size
    owners = [-1] * len(names)
    for i in sorted((i for i in range(len(names)) if trained[i]), key=lambda i: -nbytes[i]):
        r = min(range(size), key=lambda k: (loads[k], k))
        owners[i] = r
        loads[r] += nbytes[i]
    return Partition(tuple(names), tuple(owners), tuple(int(b) for b in nbytes), size)


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
class _Layout:
    """The flat buffers of one dtype: parameters in owner order, rank r's contiguous."""

    dtype: Any
    order: List[int]                  # trainer indices, owner-ordered
    offsets: Dict[int, Tuple[int, int]]  # index -> (start, end) in `send` and `weights`
    sizes: List[int]                  # elements each rank owns
    send: nd.NDArray                  # every gradient of this dtype
    weights: nd.NDArray               # every weight of this dtype
    minus_zero: nd.NDArray            # -0.0, as long as the largest part (the gather's)

    def owned(self, rank: int) -> slice:
        """Rank `rank`'s part of `send` and `weights`."""
        start = sum(self.sizes[:rank])
        return slice(start, start + self.sizes[rank])


def _layouts(params: Sequence[Any], part: Partition, size: int) -> List[_Layout]:
    """The flat buffers of each dtype, parameters in owner order."""
    by_dtype: Dict[Any, List[int]] = {}
    for i in sorted((i for i, r in enumerate(part.owners) if r >= 0),
                    key=lambda i: (part.owners[i], i)):
        by_dtype.setdefault(np.dtype(params[i].dtype), []).append(i)
    ctx = params[0].list_ctx()[0]
    out = []
    for dtype, order in by_dtype.items():
        sizes, offsets, at = [0] * size, {}, 0
        for i in order:               # owner-ordered: rank r's parameters are contiguous
            n = int(np.prod(params[i].shape))
            offsets[i] = (at, at + n)
            sizes[part.owners[i]] += n
            at += n
        out.append(_Layout(
            dtype=dtype, order=order, offsets=offsets, sizes=sizes,
            send=nd.zeros((at,), ctx=ctx, dtype=dtype),
            weights=nd.zeros((at,), ctx=ctx, dtype=dtype),
            minus_zero=nd.negative(nd.zeros((max(sizes),), ctx=ctx, dtype=dtype))))
    return out


class ShardedTrainer(_compat.StepHookTrainer):
    """A gluon Trainer that shards the optimizer state over Horovod ranks (see the module
    docstring). Use it where you would write ``hvd.DistributedTrainer``, after
    ``hvd.init()`` and `mx_lbsgd.distributed.broadcast_parameters`::

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
        Any optimizer; mx_lbsgd's (``'lbsgd'``, ``'lssgd'``, ``'lblamb'``) add loss
        scaling, clipping and windows over the shards.
    optimizer_params : dict, optional
    prefix : str, default 'sharded'
        Prefix of the names of its Horovod collectives (distinct per Trainer in one job).

    Raises
    ------
    RuntimeError
        Horovod is not installed with MXNet support, or ``hvd.init()`` was not called.
    ValueError
        Sparse gradients, fewer trained parameters than ranks, a parameter on several
        contexts, or (once, before the first step) parameters that differ across ranks.

    Examples
    --------
    It needs a Horovod job (``horovodrun -np 2 python train.py``), so the lines that run
    it are skipped here. Each rank keeps the optimizer state of the parameters it owns
    (``trainer.partition``) and trains with the per-rank batch:

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
    >>> trainer.partition.by_name()          # 2 ranks       # doctest: +SKIP
    {'dense0_weight': 0, 'dense0_bias': 1}
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
        params = _compat.trainer_params(self)
        sparse = [p.name for p in params if p.grad_req != 'null'
                  and _compat.grad_stype(p) != 'default']
        if sparse:
            raise ValueError('ShardedTrainer: parameter(s) %s have sparse gradients; the '
                             'sharded exchange takes dense gradients only (use '
                             'hvd.DistributedTrainer for them)' % ', '.join(map(repr, sparse)))
        trained = sum(p.grad_req != 'null' for p in params)
        if trained < self.size:
            raise ValueError('ShardedTrainer: %d trained parameters for %d ranks; every rank '
                             'must own at least one' % (trained, self.size))
        self._partition: Optional[Partition] = None
        self._mine: Optional[List[int]] = None
        self._mine_set: frozenset = frozenset()
        self._layouts: List[_Layout] = []
        self._accs: Dict[int, nd.NDArray] = {}
        self._sum_sq: Optional[nd.NDArray] = None
        self._checked = False
        if all(_compat.parameter_initialized(p) for p in params):
            # check, and rebind the parameters to the flat buffers now, before any forward
            # pass (a hybridized block's cached graph then only ever sees the views)
            self._prepare()

    # -- the partition ----------------------------------------------------------------
    @property
    def partition(self) -> Partition:
        """Which rank owns which parameter (the parameters must be initialized)."""
        if self._partition is None:
            params = _compat.trainer_params(self)
            names = [p.name for p in params]
            for p in params:
                if any(d == 0 for d in p.shape):
                    raise RuntimeError('ShardedTrainer: parameter %r has an unknown shape %s;'
                                       ' run a forward pass first' % (p.name, p.shape))
            self._partition = partition(
                names, [int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize for p in params],
                [p.grad_req != 'null' for p in params], self.size)
        return self._partition

    def _owned(self) -> List[int]:
        """The trainer indices this rank owns (the partition is fixed: computed once)."""
        if self._mine is None:
            self._mine = self.partition.owned(self.rank)
        return self._mine

    def _owned_set(self) -> frozenset:
        if not self._mine_set:
            self._mine_set = frozenset(self._owned())
        return self._mine_set

    def _prepare(self) -> None:
        if not self._checked:
            _check_same_everywhere(self)
            self._checked = True
        if self._layouts or self.size == 1:
            return
        params = _compat.trainer_params(self)
        for p in params:
            if len(p.list_ctx()) != 1:
                raise ValueError('ShardedTrainer: parameter %r lives on %d contexts; use one '
                                 'context per rank' % (p.name, len(p.list_ctx())))
        self._layouts = _layouts(params, self.partition, self.size)
        for layout in self._layouts:      # every weight and gradient a view of the buffers
            for i in layout.order:
                param, (a, b) = params[i], layout.offsets[i]
                _compat.rebind_parameter(param, layout.weights[a:b].reshape(param.shape),
                                         layout.send[a:b].reshape(param.shape))

    # -- the exchange -----------------------------------------------------------------
    def _reduce_gradients(self) -> None:
        """The reduction of ``step`` (gluon's ``_allreduce_grads``, through
        `_compat.StepHookTrainer`)."""
        self._prepare()
        self._sum_sq = None
        if self.size == 1:
            return
        owned = self._owned_set()
        params = _compat.trainer_params(self)
        for k, layout in enumerate(self._layouts):
            # the gradients are views of `send`: the sums land in place
            self._hvd.allreduce_(layout.send, average=False,
                                 name='%s.grad.%d' % (self._hvd_prefix, k))
        # reduced by their owners: nothing to update here
        _compat.clear_fresh_gradients(p for i, p in enumerate(params) if i not in owned)
        if getattr(self.optimizer, 'wants_step_gradients', lambda: False)():
            self._sum_sq = self._global_sum_of_squares()

    def reduced_sum_of_squares(self) -> nd.NDArray:
        """The sum of squares of this step's reduced gradients over every rank's shard, a
        (1,) device array (one small allreduce, unless the step already made it)."""
        if self._sum_sq is None:
            self._sum_sq = self._global_sum_of_squares()
        return self._sum_sq

    def _global_sum_of_squares(self) -> nd.NDArray:
        params = _compat.trainer_params(self)
        owned = self._owned() if self.size > 1 else range(len(params))
        local = _kernels.total_sum_squares(
            [_compat.legacy(params[i].list_grad()[0]) for i in owned
             if params[i].grad_req != 'null'])
        if self.size == 1:
            return local
        return self._hvd.allreduce(local, average=False, name='%s.sumsq' % self._hvd_prefix)

    def step_sum_of_squares(self) -> Optional[nd.NDArray]:
        """The sum of squares of this step's reduced gradients over every rank's shard (a
        (1,) device array), or None when the optimizer does not need it."""
        return self._sum_sq

    def _update_weights(self, ignore_stale_grad: bool = False) -> None:
        """The update of ``step`` (gluon's ``_update``, through
        `_compat.StepHookTrainer`): this rank's parameters only."""
        owned = self._owned_set() if self.size > 1 else None
        updates = []
        for i, param in enumerate(_compat.trainer_params(self)):
            if param.grad_req == 'null':
                continue
            data = param.list_data()[0]
            if owned is not None and i not in owned:
                _compat.set_fresh(data, False)
                continue
            fresh = _compat.is_fresh(data)
            if not fresh and not ignore_stale_grad:
                raise UserWarning('Gradient of Parameter `%s` on context %s has not been '
                                  'updated by backward since last `step`' % (
                                      param.name, data.context))
            if fresh or not ignore_stale_grad:
                updates.append((i, _compat.legacy(param.list_grad()[0]), _compat.legacy(data)))
                _compat.set_fresh(data, False)
        before = getattr(self.optimizer, 'applied_updates', None)
        if updates:
            index, grads, weights = zip(*updates)
            _compat.trainer_updaters(self)[0](index, grads, weights)
        after = getattr(self.optimizer, 'applied_updates', None)
        if self.size > 1 and (before is None or after != before):
            self._gather_weights()

    def _gather_weights(self) -> None:
        # the weights are views of `weights`: every rank but a parameter's owner
        # contributes -0.0 to it (x + -0.0 is x, bit for bit), and the sums land in place
        for k, layout in enumerate(self._layouts):
            for r in range(self.size):
                if r != self.rank and layout.sizes[r]:
                    layout.minus_zero[:layout.sizes[r]].copyto(
                        layout.weights[layout.owned(r)])
            self._hvd.allreduce_(layout.weights, average=False,
                                 name='%s.weight.%d' % (self._hvd_prefix, k))

    def exchange_bytes(self) -> Dict[str, int]:
        """Bytes this rank sends per update in ring algorithms: ``reduce`` (the gradients'
        allreduce), ``gather`` (the weights' allreduce), ``norm`` (the sum of squares), and
        ``ring_allreduce`` (what a ring allreduce of the gradients sends per rank, as
        ``hvd.DistributedTrainer`` does)."""
        self._prepare()
        n = self.size
        reduce_ = gather = total = 0
        for layout in self._layouts:
            item = np.dtype(layout.dtype).itemsize
            total += sum(layout.sizes) * item
            reduce_ += int(2 * (n - 1) * sum(layout.sizes) * item / n)
            gather += int(2 * (n - 1) * sum(layout.sizes) * item / n)
        return {'reduce': reduce_, 'gather': gather, 'norm': 4 if n > 1 else 0,
                'ring_allreduce': int(2 * (n - 1) * total / n)}

    # -- windows, memory --------------------------------------------------------------
    def window_accumulator(self, index: int, weight: nd.NDArray) -> Optional[nd.NDArray]:
        """The fp32 accumulator of parameter `index` for a window at this Trainer: the
        optimizer state's for an owned parameter, one of this Trainer's otherwise (each
        rank sums its own micro-batches of every parameter before the one exchange)."""
        if self.size == 1 or index in self._owned_set():
            state = _compat.updater_state(_compat.trainer_updaters(self)[0], index, weight)
            return self.optimizer.split_state(weight, state)[2]
        acc = self._accs.get(index)
        if acc is None:
            acc = self._accs[index] = nd.zeros(weight.shape, weight.context, dtype='float32')
        return acc

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: fp32 master copies, moments and
        momentum of the parameters it owns (the window's accumulators are apart)."""
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
        updater = _compat.trainer_updaters(self)[0]
        mine = updater.states
        full = _gather_states(self, updater, opt)
        trained = [i for i, p in enumerate(_compat.trainer_params(self))
                   if p.grad_req != 'null']
        counts = _fill_counts(opt, trained)
        try:
            updater.states = full
            if self.rank == 0:
                checkpoint.save_states(self, fname)
        finally:
            updater.states = mine
            _compat.set_update_counts(opt, counts)
        if self.size > 1:         # every rank returns once rank 0 has written the file
            self._hvd.allreduce(nd.zeros((1,)), name='%s.saved' % self._hvd_prefix).asnumpy()

    def load_states(self, fname: str) -> None:
        """Load a states file of this model (consolidated, unsharded, from any world size)
        on every rank, keeping the states of the parameters this rank owns."""
        checkpoint.load_states(self, fname)
        if self.size > 1:
            owned = self._owned_set()
            updater = _compat.trainer_updaters(self)[0]
            updater.states = {i: s for i, s in updater.states.items() if i in owned}
            updater.states_synced = dict.fromkeys(updater.states, False)


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
        weight = params[i].list_data()[0]
        if split is not None:
            family, master, acc = split(weight, held)
            held = (family, master)
            accs += 0 if acc is None else acc.size * 4
        state += sum(a.size * np.dtype(a.dtype).itemsize for a in _arrays(held))
    return state, accs


def _gather_states(trainer: ShardedTrainer, updater: Any, opt: Any) -> Dict[int, Any]:
    """Every parameter's optimizer state on every rank, broadcast from its owner (the
    owner's state is created first if it has not updated yet)."""
    full = {}
    for i, param in enumerate(_compat.trainer_params(trainer)):
        owner = trainer.partition.owners[i] if trainer.size > 1 else 0
        if owner < 0:
            continue
        weight = _compat.legacy(param.list_data()[0])
        if owner == trainer.rank:
            if i not in updater.states:
                updater.states[i] = opt.create_state_multi_precision(i, weight)
                updater.states_synced[i] = True
            state = updater.states[i]
        else:       # a buffer of the owner's layout, which the broadcast fills
            state = opt.create_state_multi_precision(i, weight)
        collectives.broadcast_(_arrays(state), root_rank=owner,
                               name='%s.state.%d' % (trainer._hvd_prefix, i))
        full[i] = state
    return full


def _arrays(state: Any) -> List[nd.NDArray]:
    """The arrays of a (nested) state, in order."""
    if isinstance(state, nd.NDArray):
        return [state]
    if isinstance(state, (tuple, list)):
        return [a for part in state for a in _arrays(part)]
    return []


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
