"""Every use of MXNet's private internals, one function each.

Each function says why the public API does not suffice. All were checked against MXNet
1.9.1 (the version ``setup.py`` pins); the pure layers (``schedules``, ``loss_scale``) use
none. Nothing else in the package touches a private MXNet (or Horovod-MXNet) attribute,
nor overrides one (`StepHookTrainer` holds the Trainer's hooks):
``tests/test_private_internals.py`` enforces it on the source of every other module, with
the private names collected from MXNet's own classes and objects.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import os
import sys
import weakref
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, TypeVar

import mxnet as mx

from . import _identity

_T = TypeVar('_T')

#: the installer of Horovod's exit drain (`mx_lbsgd.distributed.horovod_exit.install`,
#: which registers itself here when it is imported: the package's __init__ imports it)
_exit_drain: list[Callable[[bool], None]] = []


def register_exit_drain(install: Callable[[bool], None]) -> None:
    """Called once by `mx_lbsgd.distributed.horovod_exit` with its ``install``; every
    Horovod detection below calls it (``install(refresh)``)."""
    _exit_drain[:] = [install]


def _install_exit_drain(refresh: bool = False) -> None:
    for install in _exit_drain:
        install(refresh)


def trainer_assigning_rescale_grad(optimizer: mx.optimizer.Optimizer
                                   ) -> mx.gluon.Trainer | None:
    """The gluon.Trainer whose ``step``/``update`` is assigning ``optimizer.rescale_grad``
    right now (call it from the setter), or None.

    Why: MXNet never tells an optimizer which Trainer drives it. ``Parameter._trainer`` names
    only the last Trainer created over a parameter (two Trainers may share parameters);
    ``Trainer.step`` and ``Trainer.update`` assign ``rescale_grad`` inside
    ``_check_and_rescale_grad(self, scale)``, before they reduce or update, and that frame's
    ``self`` is the Trainer that is stepping.
    """
    frame = sys._getframe(2)           # 0: here, 1: the rescale_grad setter
    if frame is None or frame.f_code.co_name != '_check_and_rescale_grad':
        return None
    trainer = frame.f_locals.get('self')
    if isinstance(trainer, mx.gluon.Trainer) and trainer._optimizer is optimizer:
        return trainer
    return None


def init_trainer_kvstore(trainer: mx.gluon.Trainer) -> None:
    """Create the Trainer's kvstore now (idempotent), so ``update_on_kvstore`` is decided.

    Why: ``Trainer.step`` creates it lazily, after it has set ``rescale_grad``; a loss-scaled
    optimizer must refuse updates on the kvstore before the kvstore calls it inside a ctypes
    callback, which would swallow the exception.
    """
    if not trainer._kv_initialized:
        trainer._init_kvstore()


def trainer_updates_on_kvstore(trainer: mx.gluon.Trainer) -> bool:
    """True when the Trainer's kvstore updates the weights (``update_on_kvstore``)."""
    return bool(trainer._kvstore) and bool(trainer._update_on_kvstore)


def trainer_kvstore_requested_updates(trainer: mx.gluon.Trainer) -> bool | None:
    """The ``update_on_kvstore`` argument the Trainer was created with (None: automatic)."""
    return trainer._kvstore_params.get('update_on_kvstore')


def init_trainer_params(trainer: mx.gluon.Trainer) -> None:
    """Create the kvstore and push the initial weights (``Trainer.step`` does it lazily)."""
    init_trainer_kvstore(trainer)
    if trainer._params_to_init:
        trainer._init_params()


def trainer_updaters(trainer: mx.gluon.Trainer) -> list[mx.optimizer.Updater]:
    """The Trainer's per-device ``mx.optimizer.Updater`` objects (they own the states).

    Why: ``Trainer.save_states`` writes only the first device's states; per-device
    accumulators differ between devices before they are reduced.
    """
    return trainer._updaters


def trainer_scale(trainer: mx.gluon.Trainer) -> float:
    """The factor ``Trainer.step`` divides by the batch size to get ``rescale_grad``."""
    return trainer._scale


def fresh_gradients(param_dict: Mapping[Any, mx.gluon.Parameter]) -> list[mx.nd.NDArray]:
    """Every gradient, on every device, that backward wrote since the last update.

    Why: ``Trainer._update`` clears the ``_fresh_grad`` flags while it hands the gradients
    to the per-device updaters, so a step-level decision must list them before that (from
    the ``rescale_grad`` setter, which ``Trainer.step`` and ``Trainer.update`` call first).
    """
    grads = []
    for param in param_dict.values():
        # Parameter._data / _grad: the per-device lists list_data()/list_grad() return,
        # read directly (this runs every step; the public calls re-check initialisation)
        if param._grad_req == 'null' or param._data is None or param._grad is None:
            continue
        grads += [legacy(g) for d, g in zip(param._data, param._grad) if d._fresh_grad]
    return grads


def legacy(array: mx.nd.NDArray) -> mx.nd.NDArray:
    """A legacy ``mx.nd.NDArray`` view of an ``mx.np`` array (the ``multi_*`` and
    ``all_finite`` operators accept only legacy arrays); legacy arrays pass through."""
    as_nd = getattr(array, 'as_nd_ndarray', None)
    return as_nd() if as_nd is not None else array


def module_updater(mod: mx.module.Module) -> mx.optimizer.Updater | None:
    """A bound Module's ``mx.optimizer.Updater`` (None when the kvstore updates)."""
    return mod._updater


def module_optimizer(mod: mx.module.Module) -> mx.optimizer.Optimizer | None:
    return getattr(mod, '_optimizer', None)


def module_kvstore(mod: mx.module.Module) -> tuple[mx.kvstore.KVStore | None, bool | None]:
    return mod._kvstore, mod._update_on_kvstore


def creating_module_updates_on_kvstore() -> bool:
    """True when the optimizer under construction is being created by
    ``Module.init_optimizer`` for a kvstore that will update the weights.

    Why: Module decides ``update_on_kvstore`` before it creates the optimizer and never
    tells it; a local kvstore then calls the optimizer inside a ctypes callback, where an
    exception is printed and ignored. The only signal is ``init_optimizer``'s local
    variables, read from the call stack (the one place that inspects frames).
    """
    local = _init_optimizer_locals()
    return local is not None and bool(local['update_on_kvstore']) and \
        local.get('kvstore') is not None


def module_sparse_gradients_on_dist_kvstore() -> tuple[str | None, list[str]]:
    """Inside ``Module.init_optimizer`` with a dist kvstore: its type and the names of the
    parameters with dense weights and row_sparse gradients (``sym.Embedding(sparse_grad=
    True)``), which MXNet 1.9.1's server aborts on. Same call-stack read as above: Module
    hands the kvstore the optimizer (``set_optimizer`` pickles it) and nothing else."""
    local = _init_optimizer_locals()
    kv = local.get('kvstore') if local is not None else None
    if local is None or not isinstance(kv, mx.kvstore.KVStore) or 'dist' not in kv.type:
        return None, []
    group = local['self']._exec_group
    return kv.type, [name for name, ws, gs in zip(group.param_names, group.param_arrays,
                                                  group.grad_arrays)
                     if gs and gs[0] is not None and gs[0].stype == 'row_sparse'
                     and ws[0].stype == 'default']


def _init_optimizer_locals() -> dict[str, Any] | None:
    frame = sys._getframe(1)
    for _ in range(12):
        back = frame.f_back
        if back is None:
            return None
        frame = back
        local = frame.f_locals
        if (frame.f_code.co_name == 'init_optimizer'
                and isinstance(local.get('self'), mx.module.BaseModule)
                and 'update_on_kvstore' in local):
            return local
    return None


def patch_operator_invoke(hook: Callable[[Any], object]) -> Callable[[], None]:
    """Call ``hook(handle)`` for every imperative operator call made through ``mx.nd``;
    returns a function that undoes it. For counting kernel launches in tests/benchmarks.

    Why: MXNet has no public operator-call counter; every generated ``mx.nd`` operator goes
    through ``mxnet.ndarray.register._imperative_invoke``.
    """
    from mxnet.ndarray import register
    original = register._imperative_invoke

    def counting(handle: Any, *args: Any, **kwargs: Any) -> Any:
        hook(handle)
        return original(handle, *args, **kwargs)
    register._imperative_invoke = counting
    _INVOKE_HOOKS.append(hook)          # `invoke_prepared`'s calls

    def undo() -> None:
        register._imperative_invoke = original
        _INVOKE_HOOKS.remove(hook)
    return undo


#: the hooks of `patch_operator_invoke`, which `invoke_prepared` calls too
_INVOKE_HOOKS: list[Callable[[Any], object]] = []


def trainer_params(trainer: mx.gluon.Trainer) -> list[mx.gluon.Parameter]:
    """The Trainer's parameters in index order (the indices its updaters use)."""
    return trainer._params


def is_fresh(array: mx.nd.NDArray) -> bool:
    """Whether backward wrote this parameter array's gradient since the last update
    (NDArray's ``_fresh_grad`` flag, which Trainer reads and clears; no public accessor)."""
    return array._fresh_grad


def updater_state(updater: mx.optimizer.Updater, index: int, weight: mx.nd.NDArray) -> Any:
    """The Updater's state for `index`, created or moved to `weight`'s context exactly as
    ``Updater.__call__`` would (the accumulation window needs it before the Updater runs)."""
    if index not in updater.states:
        updater.states[index] = updater.optimizer.create_state_multi_precision(index, weight)
        updater.states_synced[index] = True
    elif not updater.states_synced[index]:
        updater.states[index] = updater.sync_state_context(updater.states[index],
                                                           weight.context)
        updater.states_synced[index] = True
    return updater.states[index]


def module_param_arrays(mod: mx.module.Module
                        ) -> tuple[list[list[mx.nd.NDArray]], list[str]]:
    """A bound Module's parameter arrays (per parameter, per device) and their names, in the
    order its Updater keys them (index * num_devices + device)."""
    group = mod._exec_group
    return group.param_arrays, group.param_names


def exit_when_server_command_fails(server: mx.kvstore.KVStoreServer
                                   ) -> mx.kvstore.KVStoreServer:
    """Make a ``mx.kv.KVStoreServer`` end its process (status 1, traceback on stderr) when a
    command from the workers fails, instead of going on; call it before ``server.run()``.

    Why: the only command is ``kv.set_optimizer`` (the pickled optimizer). The server loop
    calls the Python controller through a ctypes callback, where an exception (an optimizer
    class the server cannot import, a refused unpickle) is printed and ignored: the server
    then sums gradients without updating and the job trains nothing. ``KVStoreServer.run``
    takes its controller from the private ``_controller()`` factory, the one place to wrap
    it. Checked on MXNet 1.9.1 (``mxnet/kvstore/kvstore_server.py``).
    """
    import traceback
    control = server._controller()

    def controller(*args: Any) -> None:
        try:
            control(*args)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
    server._controller = lambda: controller
    return server


def on_kvstore_server() -> bool:
    """Whether this process is a ps-lite server of a dist kvstore, where MXNet's server loop
    (``kvstore_dist_server.h``) calls the optimizer with buffers it owns. ``DMLC_ROLE`` is
    what MXNet itself reads to decide that."""
    return os.environ.get('DMLC_ROLE') == 'server'


def grad_stype(param: mx.gluon.Parameter) -> str:
    """A gluon Parameter's gradient storage type (Parameter has no public accessor)."""
    return getattr(param, '_grad_stype', 'default')


def trainer_kvstore_type(trainer: mx.gluon.Trainer) -> str | None:
    """The type of the kvstore a Trainer was asked for ('dist_sync', 'device', ...; None for
    none), before ``Trainer.step`` creates it: ``_kvstore_params`` holds the argument."""
    kv = trainer._kvstore_params.get('kvstore')
    if isinstance(kv, mx.kvstore.KVStoreBase):     # MXNet's, or a custom store
        return kv.type
    return kv if isinstance(kv, str) else None


def trainer_worker_count(trainer: mx.gluon.Trainer, default: _T) -> int | _T:
    """How many workers' gradients the Trainer's reduction sums: Horovod's size for Horovod's
    DistributedTrainer, the kvstore's ``num_workers`` once ``Trainer.step`` created it, 1
    without a dist kvstore, and `default` for a dist kvstore not created yet.

    Why: Horovod's trainer passes no kvstore to gluon.Trainer (it overrides the private
    ``_allreduce_grads``), and a Trainer creates its kvstore lazily into ``_kvstore``."""
    if _is_horovod_trainer(trainer):
        import horovod.mxnet as hvd
        _install_exit_drain()
        return hvd.size()
    if trainer._kv_initialized and trainer._kvstore is not None:
        return trainer._kvstore.num_workers
    given = trainer._kvstore_params.get('kvstore')
    if isinstance(given, mx.kvstore.KVStoreBase):   # MXNet's, or a custom store
        return given.num_workers
    kind = trainer_kvstore_type(trainer)
    return default if kind and kind.startswith('dist') else 1


def dense_weights_with_sparse_gradients(trainer: mx.gluon.Trainer) -> list[str]:
    """Names of the Trainer's parameters with default-storage weights and row_sparse
    gradients (``Embedding(sparse_grad=True)``); Parameter has no public ``stype``."""
    return [p.name for p in trainer_params(trainer)
            if grad_stype(p) != 'default' and getattr(p, '_stype', 'default') == 'default']


def has_sparse_gradients(trainer: mx.gluon.Trainer) -> bool:
    return any(grad_stype(p) != 'default' for p in trainer_params(trainer))


def mul_scalar(array: mx.nd.NDArray, scalar: float, out: mx.nd.NDArray) -> mx.nd.NDArray:
    """``out = array * scalar`` written into `out`.

    Why: the public ``array * scalar`` allocates a new array every call; the accumulation
    window runs it every micro-batch on every gradient. ``nd._internal._mul_scalar`` is the
    operator behind it and takes ``out``."""
    return mx.nd._internal._mul_scalar(array, scalar=scalar, out=out)


def buffer_id(array: mx.nd.NDArray) -> int:
    """An id of the memory an NDArray refers to: two Python NDArray objects (an ``mx.np``
    array and its legacy view) share it. Why: NDArray has no public identity of its
    buffer; its ctypes ``handle`` is that identity."""
    return array.handle.value


def update_counts(opt: mx.optimizer.Optimizer
                  ) -> tuple[dict[int, dict[Any, int]], dict[Any, int]]:
    """(all per-device update counts, the current device's) of any MXNet Optimizer.

    Why: checkpoints must restore them bit for bit, and the optimizer shell reads and rewinds
    them (a skipped window); MXNet keeps them in ``_all_index_update_counts`` (a dict per
    device id) and ``_index_update_count`` (one of those dicts), with no public accessor."""
    return opt._all_index_update_counts, opt._index_update_count


def set_update_counts(opt: mx.optimizer.Optimizer,
                      counts: Mapping[Any, Mapping[Any, Any]]) -> None:
    """Replace every update count (``{device id: {index: count}}``), keeping the optimizer's
    current device."""
    current = next((k for k, v in opt._all_index_update_counts.items()
                    if v is opt._index_update_count), 0)
    opt._all_index_update_counts = {int(k): {i: int(n) for i, n in v.items()}
                                    for k, v in counts.items()} or {0: {}}
    opt._index_update_count = opt._all_index_update_counts.setdefault(current, {})


def kvstore_updater(kvstore: mx.kvstore.KVStore | None) -> mx.optimizer.Updater | None:
    """The ``mx.optimizer.Updater`` a local kvstore updates with (Module with
    ``update_on_kvstore``): where its optimizer states live. KVStore exposes only
    ``save_optimizer_states``, which writes MXNet's format without our progress."""
    return getattr(kvstore, '_updater', None)


def wrap_trainer_step(trainer: mx.gluon.Trainer, reduce: Callable[[Callable[[], Any]], Any],
                      update: Callable[..., Any]) -> None:
    """Route this Trainer's gradient reduction through ``reduce(original)`` and its
    per-device update through ``update(original, *args, **kwargs)``.

    Why: accumulating micro-batches before communicating needs a say in ``Trainer.step``'s
    reduction, which only the private ``_allreduce_grads`` gives (horovod's
    DistributedTrainer overrides the same method, so this covers it too); a step-level
    overflow decision must list the fresh gradients before ``_update`` clears their flags.
    ``step``, ``allreduce_grads`` and ``update`` all go through these two.

    Every Trainer the package drives is bound here once: a Horovod DistributedTrainer also
    gets the exit drain (`horovod_worker`)."""
    if _is_horovod_trainer(trainer):
        _install_exit_drain(refresh=True)
    original_reduce = _weak_method(trainer, '_allreduce_grads')
    original_update = _weak_method(trainer, '_update')
    trainer._allreduce_grads = lambda: reduce(original_reduce)
    trainer._update = lambda *a, **k: update(original_update, *a, **k)


def _weak_method(obj: object, name: str) -> Callable[..., Any]:
    """obj.name as a callable that holds `obj` weakly (a wrapper stored on `obj` that held
    the bound method would keep `obj` alive until the cyclic garbage collector runs)."""
    bound = getattr(obj, name)
    func = getattr(bound, '__func__', None)
    if func is None or getattr(bound, '__self__', None) is not obj:
        return bound                   # already wrapped by someone else: keep it as it is
    ref = weakref.ref(obj)
    return lambda *a, **k: func(ref(), *a, **k)


# -- added for overflow reports (mx_lbsgd.overflow): which worker this is -----------------

def trainer_rank(trainer: mx.gluon.Trainer) -> int | None:
    """This worker's rank in the Trainer's reduction (None without a dist kvstore or Horovod).

    Why: a Trainer creates its kvstore lazily into the private ``_kvstore``; Horovod's
    DistributedTrainer has none and reduces through horovod, whose rank is ``hvd.rank()``."""
    if _is_horovod_trainer(trainer):
        import horovod.mxnet as hvd
        _install_exit_drain()
        return hvd.rank()
    kv = trainer._kvstore if trainer._kv_initialized else None
    return kv.rank if kv is not None and 'dist' in kv.type else None


def rebind_parameter(param: mx.gluon.Parameter, data: mx.nd.NDArray,
                     grad: mx.nd.NDArray) -> None:
    """Make `data` and `grad` (views into a sharded Trainer's flat buffers, holding the
    parameter's current values) the single-context parameter's weight and gradient arrays.

    Why: Gluon keeps them in the private ``_data`` / ``_grad`` lists and marks them for
    autograd once (``Parameter._init_grad``); with views, the sharded exchange sends the
    gradients and receives the weights in place instead of copying every tensor in and
    out of flat buffers (measured: the copies took half of the exchange)."""
    data[:] = param._data[0]
    grad[:] = param._grad[0]
    fresh = param._data[0]._fresh_grad
    param._data = [data]
    param._grad = [grad]
    mx.autograd.mark_variables([data], [grad], param.grad_req)
    data._fresh_grad = fresh


#: the number of each Trainer that `sum_over_workers` served, in the order of first use (the
#: same on every worker): its Horovod name and dist kvstore key. Numbers are never reused:
#: a Trainer is freed when the cyclic collector runs, which is not at the same time on
#: every worker, so a count of the live ones would name two Trainers alike on one worker
#: and not on another (and the job would hang in the reduction)
_WORKER_SUMS: 'weakref.WeakKeyDictionary[mx.gluon.Trainer, int]' = weakref.WeakKeyDictionary()
_WORKER_SUM_NUMBERS = itertools.count()


def sum_over_workers(trainer: mx.gluon.Trainer, array: mx.nd.NDArray) -> None:
    """Sum a small float32 `array` over the workers of the Trainer's job, in place and
    asynchronously (the engine orders it; nothing is read): Horovod's allreduce (in the
    Trainer's process set) for Horovod's DistributedTrainer and `mx_lbsgd.ShardedTrainer`,
    a push and pull of a key of its own on a dist kvstore (whose servers sum), nothing
    with one worker. Every worker must call it at the same point of its step.

    Why: the Trainer keeps its kvstore in the private ``_kvstore`` and Horovod's its
    process set in ``_process_set``; the Trainer's parameters use the kvstore's int keys
    0..n-1, so the keys here start at 2^20 (inited on first use, which on a dist kvstore
    every worker does at once). A kvstore that compresses gradients would quantise the sum:
    refused."""
    number = _WORKER_SUMS.get(trainer)
    first = number is None
    if number is None:
        number = _WORKER_SUMS[trainer] = next(_WORKER_SUM_NUMBERS)
    if _is_horovod_trainer(trainer):
        import horovod.mxnet as hvd
        process_set = getattr(trainer, '_process_set', hvd.global_process_set)
        if process_set.size() > 1:
            hvd.allreduce_(array, average=False, name='mx_lbsgd.sum_over_workers.%d' % number,
                           process_set=process_set)
        return
    kv = trainer._kvstore
    if kv is None or kv.num_workers == 1:
        return
    if trainer._compression_params:
        raise ValueError('a measurement summed over the workers (lr_scaling=\'adascale\') '
                         'cannot go through a kvstore with gradient compression (%r): the sum '
                         'would be quantised' % (trainer._compression_params,))
    key = (1 << 20) + number
    if first:
        kv.init(key, mx.nd.zeros(array.shape, dtype=array.dtype))
    kv.push(key, array)
    kv.pull(key, out=array)


def _is_horovod_trainer(trainer: object) -> bool:
    return type(trainer).__module__.split('.')[0] == 'horovod' or \
        type(trainer).__name__ == 'ShardedTrainer'


def horovod_worker() -> tuple[int, int] | None:
    """(rank, size) when horovod.mxnet is imported and initialized, else None.

    Why: horovod's DistributedOptimizer (Module) reduces before it calls the wrapped
    optimizer and tells it nothing; horovod's rank is process-wide.

    Every Horovod detection of the package (this and the DistributedTrainer branches above)
    also keeps the exit drain registered after ``hvd.init()``'s ``atexit`` hook: see
    `mx_lbsgd.distributed.horovod_exit` (MXNet 1.9.1 can crash or hang when Horovod shuts
    down at exit with collectives still queued in its engine)."""
    hvd = sys.modules.get('horovod.mxnet')
    if hvd is None or not hvd.is_initialized():
        return None
    _install_exit_drain()
    return hvd.rank(), hvd.size()


def creating_module_worker() -> tuple[int, int] | None:
    """(rank, num_workers) of the dist kvstore that ``Module.init_optimizer`` is creating
    this optimizer for, else None.

    Why: Module never tells its optimizer the kvstore; the same call-stack read as
    `creating_module_updates_on_kvstore`.

    Every optimizer of the package calls this when it is created: under an initialized
    Horovod (``hvd.DistributedOptimizer`` wraps it for Module) that registers the exit drain
    (`horovod_worker`)."""
    if horovod_worker() is not None:
        _install_exit_drain(refresh=True)
    local = _init_optimizer_locals()
    kv = local.get('kvstore') if local is not None else None
    if not isinstance(kv, mx.kvstore.KVStore) or 'dist' not in kv.type:
        return None
    return kv.rank, kv.num_workers


# -- added for one scaler across MXNet's loaders and for the LossScaling hook ---------------

def optimizer_replaced_by_unpickling() -> mx.optimizer.Optimizer | None:
    """The optimizer that an ``mx.optimizer.Updater`` holds while its ``set_states`` unpickles
    another one to replace it (call from the unpickled optimizer's ``__setstate__``), else
    None.

    Why: ``Updater.set_states`` (what ``Trainer.load_states``, ``Module.load_optimizer_states``
    and ``KVStore.load_optimizer_states`` call) puts the optimizer pickled in the file in
    place of the live one and tells no one, so the user's loss scaler, held by the live
    optimizer, would drive nothing. While pickle runs, the ``self`` of the ``set_states``
    frame still holds the live optimizer (checked on MXNet 1.9.1,
    ``mxnet/optimizer/optimizer.py``)."""
    frame = sys._getframe(1)
    for _ in range(8):
        back = frame.f_back
        if back is None:
            return None
        frame = back
        if frame.f_code.co_name == 'set_states':
            updater = frame.f_locals.get('self')
            if isinstance(updater, mx.optimizer.Updater):
                return updater.optimizer
    return None


def reduced_gradient_mean_factor(trainer: mx.gluon.Trainer) -> float:
    """The factor that turns the gradients ``trainer.allreduce_grads()`` leaves into the mean
    over workers of each worker's gradient (summed over its devices).

    - no kvstore, one device, ``local``/``device`` kvstores: 1 (one worker; a ``device``
      kvstore sums over this worker's devices);
    - ``dist_*`` kvstores: ``1 / num_workers`` (the servers sum);
    - Horovod's DistributedTrainer: ``gradient_predivide_factor / size`` when it averages in
      the framework (CPU, gloo, ROCm and NCCL < 2.10 builds: the allreduce sums the gradients
      pre-divided by the factor, and the Trainer's ``_scale`` carries ``factor / size``),
      else 1 (NCCL >= 2.10: the allreduce itself averages).

    Why: Horovod keeps the choice in the private ``_average_in_framework`` and
    ``_gradient_predivide_factor`` (checked on horovod 0.28.1, ``horovod/mxnet/__init__.py``);
    the kvstore is created lazily into ``_kvstore``."""
    if type(trainer).__module__.split('.')[0] == 'horovod':
        if not getattr(trainer, '_average_in_framework', True):
            return 1.0
        import horovod.mxnet as hvd
        size = trainer._process_set.size() if hasattr(trainer, '_process_set') else hvd.size()
        return float(getattr(trainer, '_gradient_predivide_factor', 1.0)) / size
    if type(trainer).__name__ == 'ShardedTrainer':      # sums over ranks, as Horovod on CPU
        return 1.0 / trainer.size
    init_trainer_kvstore(trainer)
    kv = trainer._kvstore
    if kv is not None and 'dist' in kv.type:
        return 1.0 / kv.num_workers
    return 1.0


# -- added for trust ratios on kvstore servers (pipeline.servers.refuse_server_updates) ------

def module_trained_parameter_sizes() -> dict[str, int]:
    """Inside ``Module.init_optimizer``: {name: number of elements} of the Module's
    parameters that have a gradient (the ones its kvstore updates), else {}.

    Why: Module gives its optimizer the parameter names only (``param_idx2name``), and a
    trust ratio on the kvstore servers needs to know which tensors the dist kvstore splits
    across them (by size); the arrays are the executor group's (``_exec_group``), read
    through the same call-stack read as `creating_module_updates_on_kvstore` while
    ``init_optimizer`` sends the optimizer (``kv.set_optimizer``) and before it pushes any
    weight."""
    local = _init_optimizer_locals()
    if local is None:
        return {}
    group = local['self']._exec_group
    grads = group.grad_arrays or []          # None: bound for inference, nothing to update
    return {name: int(ws[0].size) for name, ws, gs in zip(group.param_names,
                                                          group.param_arrays, grads)
            if gs and gs[0] is not None}


# -- added for ShardedTrainer and the optimizer shell: no private access elsewhere ----------

class StepHookTrainer(mx.gluon.Trainer):
    """A gluon.Trainer whose subclass does the gradient reduction and the update of
    ``step`` itself: ``step``, ``allreduce_grads`` and ``update`` call the subclass's
    ``_reduce_gradients()`` and ``_update_weights(ignore_stale_grad)`` (`ShardedTrainer`).

    Why: ``Trainer.step`` reduces in the private ``_allreduce_grads`` and updates in the
    private ``_update`` (MXNet 1.9.1, ``gluon/trainer.py``), the only places to replace
    either; Horovod's DistributedTrainer overrides the same two. `wrap_trainer_step` wraps
    these overrides as it wraps MXNet's own."""

    def _allreduce_grads(self) -> None:
        self._reduce_gradients()

    def _update(self, ignore_stale_grad: bool = False) -> None:
        self._update_weights(ignore_stale_grad)

    def _reduce_gradients(self) -> None:
        raise NotImplementedError

    def _update_weights(self, ignore_stale_grad: bool = False) -> None:
        raise NotImplementedError


def horovod_reducescatter_into(tensor: mx.nd.NDArray, output: mx.nd.NDArray,
                                name: str) -> None:
    """Sum `tensor` over the Horovod ranks and write this rank's even part of the sum
    (the rank-th of N equal parts of dimension 0) into `output`, a preallocated array of
    that size (a view of a larger buffer is fine), asynchronously: MXNet's engine orders
    every reader of `output` after it, and nothing waits on the host. `output` must stay
    referenced until the operation has run.

    Why: ``horovod.mxnet.reducescatter`` (0.28.1) allocates a one-element output, lets
    the operation resize it, and waits for it on the host (``output.wait_to_read()``), a
    host sync and an allocation per call. Its C function
    ``horovod_mxnet_reducescatter_async`` writes any output whose size already fits
    (``ResizeNd`` reallocates only a smaller one). Reduce-scatter, like allreduce and
    allgather, builds its log line before it enqueues, so it does not read the freed
    name that 0.28.1's broadcast and alltoall read (`mx_lbsgd.distributed.collectives`)."""
    import ctypes
    from horovod.mxnet import mpi_ops
    from mxnet.base import c_str, check_call
    c_in, c_out = tensor.handle, output.handle
    check_call(mpi_ops.MPI_MXNET_LIB_CTYPES.horovod_mxnet_reducescatter_async(
        ctypes.byref(c_in), ctypes.byref(c_out), c_str(name), ctypes.c_int(0),
        ctypes.c_int(mpi_ops.global_process_set.process_set_id), ctypes.c_int(1),
        ctypes.c_int(mpi_ops.Sum), ctypes.c_double(1.0), ctypes.c_double(1.0)))


def horovod_allgather_into(tensor: mx.nd.NDArray, output: mx.nd.NDArray, name: str) -> None:
    """Concatenate every rank's `tensor` (equal shapes), in rank order along dimension 0,
    into `output`, a preallocated array of N times its size, asynchronously (as
    `horovod_reducescatter_into`). `tensor` must not share storage with `output`.

    Why: ``horovod.mxnet.allgather`` (0.28.1) allocates its output and waits for it on
    the host; its C function ``horovod_mxnet_allgather_async`` writes any output that
    already has the size."""
    import ctypes
    from horovod.mxnet import mpi_ops
    from mxnet.base import c_str, check_call
    c_in, c_out = tensor.handle, output.handle
    check_call(mpi_ops.MPI_MXNET_LIB_CTYPES.horovod_mxnet_allgather_async(
        ctypes.byref(c_in), ctypes.byref(c_out), c_str(name), ctypes.c_int(0),
        ctypes.c_int(mpi_ops.global_process_set.process_set_id), ctypes.c_int(1)))


def set_trainer_scale(trainer: mx.gluon.Trainer, scale: float) -> None:
    """Set the factor ``Trainer.step`` divides by the batch size to get ``rescale_grad``
    (`trainer_scale` reads it).

    Why: a Trainer whose reduction sums over ranks divides it by the world size, as Horovod's
    DistributedTrainer does on CPU (``self._scale *= factor / size``); Trainer keeps it in the
    private ``_scale`` and has no setter (``set_learning_rate`` is the only public one)."""
    trainer._scale = scale


def parameter_initialized(param: mx.gluon.Parameter) -> bool:
    """Whether a gluon Parameter holds its arrays (initialized, and not waiting for a
    deferred initialization).

    Why: Parameter has no public check; ``list_data()`` raises a RuntimeError (deferred or
    not initialized), and the arrays are the private ``_data`` list, None until then."""
    return param._data is not None


def clear_fresh_gradients(params: Iterable[mx.gluon.Parameter]) -> None:
    """Mark the gradients of `params` (initialized ones, every device) as used: Trainer's
    update then neither updates them nor warns that they are stale.

    Why: the flag is NDArray's private ``_fresh_grad`` (backward sets it, ``Trainer._update``
    reads and clears it; `is_fresh`), on the arrays of the private ``Parameter._data`` (the
    public ``list_data()`` raises for a parameter not initialized yet). One call per step
    (`ShardedTrainer` clears the parameters other ranks own)."""
    for param in params:
        if param._data is not None:
            for array in param._data:
                array._fresh_grad = False


def set_fresh(array: mx.nd.NDArray, fresh: bool) -> None:
    """Set a parameter array's ``_fresh_grad`` flag (`is_fresh` reads it): False once its
    gradient is used, as ``Trainer._update`` does. Why: NDArray has no public setter."""
    array._fresh_grad = fresh


def count_on_device(opt: mx.optimizer.Optimizer, context: mx.Context) -> None:
    """Make the update counts of `context`'s device the optimizer's current ones.

    Why: MXNet's Updater selects them (the private ``Optimizer._set_current_context``)
    before each call; the calls the loss-scale gate held back from one device run during a
    later call for another (Module on several devices), and must count on their own."""
    opt._set_current_context(context.device_id)


def count_update(opt: mx.optimizer.Optimizer, index: Any) -> None:
    """Count an update of `index` (an index or a list of them) as MXNet's optimizers do at
    the start of their ``update``: the per-index counts (``begin_num_update`` first) and
    ``num_update``, which the learning-rate scheduler reads.

    Why: the counting is the private ``Optimizer._update_count`` (MXNet 1.9.1,
    ``optimizer/optimizer.py``), which every MXNet optimizer's ``update`` calls; an optimizer
    that replaces ``update``/``update_multi_precision`` must call it itself."""
    opt._update_count(index)


def learning_rates(opt: mx.optimizer.Optimizer, indices: list[Any], lr: float) -> list[float]:
    """The learning rate of each index for an update whose rate before the per-parameter
    multipliers is `lr` (the scheduler's): `lr` times the parameter's ``lr_mult`` (by index
    or by name), in the order and arithmetic of MXNet's optimizers.

    Why: MXNet has no public function for the multipliers; its private
    ``Optimizer._get_lrs`` applies them after calling the scheduler at ``num_update``, which
    an optimizer with ``lr_scaling`` does not schedule by. This is ``_get_lrs`` of MXNet
    1.9.1 from its second line on, with the scheduler's rate handed in."""
    lrs = [lr for _ in indices]
    for i, index in enumerate(indices):
        if index in opt.param_dict:
            lrs[i] *= opt.param_dict[index].lr_mult
        elif index in opt.lr_mult:
            lrs[i] *= opt.lr_mult[index]
        elif index in opt.idx2name:
            lrs[i] *= opt.lr_mult.get(opt.idx2name[index], 1.0)
    return lrs


def weight_decays(opt: mx.optimizer.Optimizer, indices: list[Any]) -> list[float]:
    """The weight decay of each index as MXNet's optimizers compute it for an update: ``wd``
    times the parameter's ``wd_mult`` (by index or by name; Gluon sets 0 for biases and
    gammas, Module by name suffix).

    Why: the public ``wd`` is the rate before the per-parameter multipliers; the whole
    computation is the private ``Optimizer._get_wds``."""
    return opt._get_wds(indices)


# -- the native operators, loaded without touching MXNet's Python operator functions -------

def registered_operator_names() -> set[str]:
    """The names of every operator registered in MXNet's C++ registry (built in, or added by
    a library loaded into the process)."""
    import ctypes
    from mxnet.base import _LIB, check_call, py_str
    plist = ctypes.POINTER(ctypes.c_char_p)()
    size = ctypes.c_uint()
    check_call(_LIB.MXListAllOpNames(ctypes.byref(size), ctypes.byref(plist)))
    return {py_str(plist[i]) for i in range(size.value)}


def load_operator_library(path: str, names: tuple[str, ...]) -> dict[str, Callable[..., Any]]:
    """Register the operators of the library at `path` with MXNet and return an ``mx.nd``
    style function for each of `names`; no function of ``mx.nd``, ``mx.sym``, ``mx.np`` or
    ``mx.npx`` is replaced, and none is added.

    Why: the public ``mx.library.load`` calls ``MXLoadLib`` and then regenerates every
    Python operator function of ``mx.nd`` and ``mx.sym`` (``_init_op_module``), so every
    function object that ``contrib.amp.init()`` (or a user) wrapped is replaced by a fresh
    unwrapped one, silently. This calls the same C function (``MXLoadLib``, checked on
    MXNet 1.9.1, ``mxnet/library.py``) and then makes functions for the library's own
    operators only, with the generator ``_init_op_module`` uses
    (``mxnet.ndarray.register._make_ndarray_function``), so they dispatch through
    ``_imperative_invoke`` exactly as MXNet's own. A library whose operators are already
    registered (loaded before, by this or by ``mx.library.load``) is not loaded again.
    """
    import ctypes
    from mxnet.base import _LIB, OpHandle, c_str, check_call, mx_uint
    from mxnet.ndarray.register import _make_ndarray_function
    if not set(names) <= registered_operator_names():
        check_call(_LIB.MXLoadLib(ctypes.c_char_p(path.encode('utf-8')), mx_uint(0)))
    functions = {}
    for name in names:
        handle = OpHandle()
        check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
        function = _make_ndarray_function(handle, name, name)
        function.__module__ = 'mx_lbsgd._native'
        function.op_handle = handle         # for `invoke_prepared`
        functions[name] = function
    return functions


def invoke_prepared(function: Callable[..., Any], arrays: Sequence[mx.nd.NDArray],
                    attrs: Mapping[str, Any], cache: dict) -> None:
    """Call an operator of `load_operator_library` on `arrays` (inputs, updated in place;
    its outputs are dropped) with attributes `attrs`, reusing the C array of input handles
    while the call passes the same array objects as before (kept in `cache`).

    Why: the generated function (``_make_ndarray_function``) checks every input's class and
    builds the handle array on every call, a cost per array that a step with thousands of
    tensors pays each time for the same arrays; this calls the same C function
    (``MXImperativeInvokeEx``, as ``mxnet/_ctypes/ndarray.py``'s ``_imperative_invoke``,
    MXNet 1.9.1) with the handle array kept. The kept arrays are the plan's (weights,
    gradients, states), which their owners keep alive anyway."""
    import ctypes
    from mxnet.base import NDArrayHandle, _LIB, c_str_array, check_call
    for hook in _INVOKE_HOOKS:
        hook(function.op_handle)  # type: ignore[attr-defined]
    key = (function.op_handle.value, len(arrays), id(arrays[0]))  # type: ignore[attr-defined]
    handles = _identity.kept(cache, key, arrays,
                             lambda: (NDArrayHandle * len(arrays))(*[a.handle for a in arrays]))
    num_output = ctypes.c_int(0)
    outputs = ctypes.POINTER(NDArrayHandle)()
    stypes = ctypes.POINTER(ctypes.c_int)()
    check_call(_LIB.MXImperativeInvokeEx(
        ctypes.c_void_p(function.op_handle.value),  # type: ignore[attr-defined]
        ctypes.c_int(len(arrays)), handles, ctypes.byref(num_output),
        ctypes.byref(outputs), ctypes.c_int(len(attrs)), c_str_array(list(attrs)),
        c_str_array([str(v) for v in attrs.values()]), ctypes.byref(stypes)))
    for i in range(num_output.value):     # the NDArray frees its handle when dropped
        mx.nd.NDArray(ctypes.cast(outputs[i], NDArrayHandle))


def _chunk(array: mx.nd.NDArray) -> int:
    """The address of the storage chunk behind `array` (views of one array share it)."""
    import ctypes
    return ctypes.cast(array.handle, ctypes.POINTER(ctypes.c_void_p))[0] or 0


#: [whether `_chunk` tells chunks apart], probed once
_CHUNKS_READABLE: list[bool] = []


def _chunks_readable() -> bool:
    """Whether `_chunk` reads MXNet's layout as 1.9.1 has it: a view and a reshape share
    their array's chunk, another array has its own."""
    if not _CHUNKS_READABLE:
        base, other = mx.nd.zeros((8,)), mx.nd.zeros((8,))
        ids = [_chunk(base), _chunk(base[2:6]), _chunk(base.reshape((2, 4))), _chunk(other)]
        _CHUNKS_READABLE.append(ids[0] != 0 and ids[0] == ids[1] == ids[2] != ids[3])
    return _CHUNKS_READABLE[0]


def push_prepared(library: Any, op: int, function: Callable[..., Any],
                  arrays: Sequence[mx.nd.NDArray], attrs: Mapping[str, Any], cache: dict,
                  loose: Sequence[mx.nd.NDArray] = (),
                  outputs: Sequence[mx.nd.NDArray] = ()) -> bool:
    """Push the kernel of `function` (an operator of `load_operator_library`, number `op`
    of the library's ``mx_lbsgd_push``) on the inputs `arrays` then `loose`, writing
    `outputs` (none: its outputs are dropped), as one operation of MXNet's engine. The
    library's C function runs the operator's checks and calls ``MXEnginePushSyncND``. The
    inputs `arrays` are held as shallow copies (``MXShallowCopyNDArray``, kept in `cache`
    while the call passes the same array objects) that the pushed operations share;
    `loose` (inputs new at each call, such as a norm) and `outputs` are copied per call.
    The data pointers are read (``MXNDArrayGetData``) when the operation runs. False
    (nothing pushed) when the arrays are not dense float16/float32 arrays of one CPU, or
    two of them share storage; then call the operator through MXNet. Raises MXNetError on
    arguments the operator refuses, before anything runs.

    Why: ``MXImperativeInvokeEx`` infers shapes, types and storage per array and goes
    through lib_api's dispatch: 27 ms for the 12,000 arrays of a 3,000-tensor float16 SGD
    step against 0.3 ms for the push (MXNet 1.9.1, this CPU). The four functions are
    MXNet's C API (``include/mxnet/c_api.h``); the push's context argument is a pointer to
    MXNet's C++ ``Context`` (``include/mxnet/base.h``: device type, then id). The engine
    hangs on an operation that lists one variable twice (MXNet's imperative call removes
    duplicates), so the arrays must have distinct storage chunks: MXNet has no C function
    for an array's engine variable, so `_chunk` reads the chunk's address, the first member
    of the C++ ``NDArray`` behind a handle (``std::shared_ptr<Chunk> ptr_``,
    ``include/mxnet/ndarray.h``), probed at first use (`_chunks_readable`)."""
    import numpy as np
    from mxnet.base import MXNetError, NDArrayHandle, _LIB, c_str_array, check_call
    codes = _push_dtype_codes()
    prepared = _identity.kept(cache, ('push', op, len(arrays), id(arrays[0])), arrays,
                              functools.partial(_prepare_push, library, arrays))
    if prepared is None:
        return False
    held, sizes, dtypes, chunks, context = prepared
    extra = list(loose) + list(outputs)
    extra_chunks = [_chunk(a) for a in extra]
    if extra and (not _pushable(extra, arrays[0].context)
                  or len(chunks.union(extra_chunks)) != len(chunks) + len(extra)):
        return False
    for hook in _INVOKE_HOOKS:
        hook(function.op_handle)  # type: ignore[attr-defined]
    k = len(extra)
    error = ctypes.c_char_p()
    result = library.mx_lbsgd_push(
        ctypes.c_int(op), held.pointer, sizes, dtypes, ctypes.c_int(len(loose)),
        ctypes.c_int(len(outputs)), (NDArrayHandle * k)(*[a.handle for a in extra]),
        (ctypes.c_void_p * k)(*extra_chunks),
        (ctypes.c_int64 * k)(*[a.size for a in extra]),
        (ctypes.c_int * k)(*[codes[np.dtype(a.dtype)] for a in extra]),
        ctypes.c_int(len(attrs)), c_str_array(list(attrs)),
        c_str_array([str(v) for v in attrs.values()]), ctypes.byref(context),
        ctypes.cast(_LIB.MXEnginePushSyncND, ctypes.c_void_p),
        ctypes.cast(_LIB.MXNDArrayGetData, ctypes.c_void_p),
        ctypes.cast(_LIB.MXShallowCopyNDArray, ctypes.c_void_p),
        ctypes.cast(_LIB.MXNDArrayFree, ctypes.c_void_p), _reorder_function(),
        ctypes.byref(error))
    if result == -3:
        raise MXNetError((error.value or b'').decode('utf-8', 'replace'))
    if result != 0:
        check_call(result)
    return True


@functools.lru_cache(maxsize=None)
def _push_dtype_codes() -> dict:
    """lib_api's dtype codes of the arrays `push_prepared` takes (made once: every step
    pushes)."""
    import numpy as np
    return {np.dtype(np.float32): 0, np.dtype(np.float16): 2}


def _pushable(group: Sequence[mx.nd.NDArray], ctx: mx.Context) -> bool:
    """Whether `push_prepared` takes the arrays `group`: dense float32/float16 on `ctx`."""
    import numpy as np
    codes = _push_dtype_codes()
    return all(a.stype == 'default' and a.context == ctx and np.dtype(a.dtype) in codes
               for a in group)


def _prepare_push(library: Any, arrays: Sequence[mx.nd.NDArray]) -> Optional[tuple]:
    """What `push_prepared` keeps for the inputs `arrays` (their shallow copies, sizes,
    dtype codes, storage chunks and context), or None when it cannot push them."""
    import numpy as np
    from mxnet.base import NDArrayHandle
    ctx = arrays[0].context
    if ctx.device_type != 'cpu' or not _chunks_readable() or not _pushable(arrays, ctx):
        return None
    chunks = [_chunk(a) for a in arrays]
    if len(set(chunks)) != len(arrays):
        return None
    n = len(arrays)
    codes = _push_dtype_codes()
    held = _Held(library, (NDArrayHandle * n)(*[a.handle for a in arrays]),
                 (ctypes.c_void_p * n)(*chunks), n)
    return (held, (ctypes.c_int64 * n)(*[a.size for a in arrays]),
            (ctypes.c_int * n)(*[codes[np.dtype(a.dtype)] for a in arrays]),
            set(chunks), _EngineContext(1, ctx.device_id))  # Context::kCPU


def track_engine_versions(library: Any) -> bool:
    """Tell the native library (``mx_lbsgd_track_versions``) where MXNet keeps an array's
    engine version, so that LARS can take a weight's norm from the update that wrote it while
    nothing else wrote the weight since (``csrc/native_ops.cc``, "engine versions"). True
    when the layout passed `_engine_version_layout`'s probe; else the library is told
    nothing and every step reads the weights' norms.

    Why: MXNet 1.9.1 has no C function for an array's version (``NDArray::version()`` is an
    inline C++ member). The count is ``Engine::Var::version_``, the member after the virtual
    table (``include/mxnet/engine.h``); the variable is ``NDArray::Chunk::var``, after the
    storage handle (32 bytes), the auxiliary handles (a vector, 24) and, in a build with
    oneDNN, its memory (a shared_ptr, 16) (``include/mxnet/ndarray.h``, ``storage.h``)."""
    layout = _engine_version_layout()
    if layout is None:
        return False
    library.mx_lbsgd_track_versions(ctypes.c_int64(layout[0]), ctypes.c_int64(layout[1]))
    return True


def _engine_version_layout() -> Optional[tuple[int, int]]:
    """(offset of the engine variable in a chunk, offset of its version count) of this
    MXNet, or None: each candidate of `track_engine_versions`'s layouts is read through
    ``/proc/self/mem`` (a wrong address fails there instead of crashing) and kept when the
    count moves as MXNet's writes move it: +1 per write of the array, also through a view;
    unchanged by a read and by a write of another array. The probe copies to and from the
    host through MXNet's C API (no operator, no counted host sync: it runs inside the first
    step that loads the library)."""
    if _VERSION_LAYOUT:
        return _VERSION_LAYOUT[0]
    _VERSION_LAYOUT.append(None)
    import numpy as np
    from mxnet.base import NDArrayHandle, _LIB, check_call
    try:
        memory = os.open('/proc/self/mem', os.O_RDONLY)
    except OSError:
        return None

    def word(address: int) -> Optional[int]:
        try:
            data = os.pread(memory, 8, address) if address > 0 else b''
        except (OSError, OverflowError):
            return None
        return int.from_bytes(data, sys.byteorder) if len(data) == 8 else None

    def write(array: mx.nd.NDArray) -> None:      # waits for the array's pending work
        data = np.ones(array.shape, np.float32)
        check_call(_LIB.MXNDArraySyncCopyFromCPU(array.handle, data.ctypes.data_as(
            ctypes.c_void_p), ctypes.c_size_t(data.size)))

    def read(array: mx.nd.NDArray) -> None:
        data = np.empty(array.shape, np.float32)
        check_call(_LIB.MXNDArraySyncCopyToCPU(array.handle, data.ctypes.data_as(
            ctypes.c_void_p), ctypes.c_size_t(data.size)))

    try:
        a, b = mx.nd.empty((8,)), mx.nd.empty((8,))
        handle = NDArrayHandle()
        check_call(_LIB.MXNDArraySlice(a.handle, ctypes.c_uint32(2), ctypes.c_uint32(6),
                                       ctypes.byref(handle)))
        view = mx.nd.NDArray(handle)
        write(b)
        for var_offset in (72, 56):        # with oneDNN, without
            def version(array: mx.nd.NDArray, var_offset: int = var_offset) -> Optional[int]:
                var = word(_chunk(array) + var_offset)
                return word(var + 8) if var else None

            seen = [version(a), version(b)]
            write(a)
            seen.append(version(a))
            read(a)
            seen.append(version(a))
            write(view)
            seen += [version(a), version(view), version(b)]
            counts = [v for v in seen if v is not None]
            if len(counts) == len(seen):
                v, w = counts[0], counts[1]
                if counts[2:] == [v + 1, v + 1, v + 2, v + 2, w]:
                    _VERSION_LAYOUT[0] = (var_offset, 8)
                    break
    finally:
        os.close(memory)
    return _VERSION_LAYOUT[0]


#: [`_engine_version_layout`'s answer], probed once
_VERSION_LAYOUT: list = []


class _Held:
    """The library's share of shallow copies of `n` arrays (``mx_lbsgd_hold``), released
    when this object goes."""

    def __init__(self, library: Any, handles: Any, chunks: Any, n: int) -> None:
        from mxnet.base import _LIB, check_call
        self._release = library.mx_lbsgd_release
        library.mx_lbsgd_hold.restype = ctypes.c_void_p
        self.pointer = ctypes.c_void_p(library.mx_lbsgd_hold(
            ctypes.c_int(n), handles, chunks,
            ctypes.cast(_LIB.MXShallowCopyNDArray, ctypes.c_void_p),
            ctypes.cast(_LIB.MXNDArrayFree, ctypes.c_void_p)))
        if not self.pointer.value:
            check_call(-1)

    def __del__(self) -> None:
        if getattr(self, 'pointer', None) and self.pointer.value:
            self._release(self.pointer)


def _reorder_function() -> Optional[ctypes.c_void_p]:
    """MXNet's ``NDArray::Chunk::Reorder2Default()`` (a C++ member function: the chunk is its
    one argument), or None in a build without oneDNN.

    Why: oneDNN keeps some arrays in a layout of its own (a convolution's weight after a
    forward pass in predict mode); MXNet's operators put them back into the default layout
    inside the operation, and the C API's ``MXNDArrayGetData`` does it by pushing a reorder
    and waiting for it, which inside a pushed operation waits forever. The function is
    exported by the 1.9.1 wheel's ``libmxnet.so`` (``src/ndarray/ndarray.cc``): it returns at
    once for an array in the default layout, else reorders it in place, synchronously."""
    if not _REORDER:
        from mxnet.base import _LIB
        found = getattr(_LIB, '_ZN5mxnet7NDArray5Chunk15Reorder2DefaultEv', None)
        _REORDER.append(None if found is None else ctypes.cast(found, ctypes.c_void_p))
    return _REORDER[0]


#: [`_reorder_function`'s answer], looked up once
_REORDER: list = []


class _EngineContext(ctypes.Structure):
    """MXNet's C++ ``Context`` (``include/mxnet/base.h``, 1.9.1): device type, device id."""
    _fields_ = [('dev_type', ctypes.c_int), ('dev_id', ctypes.c_int32)]


#: the most elements `host_all_finite` checks (one thread): above, an operator on the
#: engine's threads is faster than the round trip it saves (1M float32: about 0.25 ms)
_HOST_CHECK_MAX_ELEMENTS = 1 << 20


def host_check_arrays(arrays: Sequence[mx.nd.NDArray], cache: dict) -> Optional[tuple]:
    """The C arrays `host_all_finite` takes for `arrays` (handles, sizes, float16 flags),
    kept in `cache` while the call passes the same array objects as before; None when an
    array is not a dense float16/float32 CPU NDArray, or the arrays hold more than
    `_HOST_CHECK_MAX_ELEMENTS` elements."""
    import ctypes
    import numpy as np

    def build() -> Optional[tuple]:
        if not all(a.stype == 'default' and a.context.device_type == 'cpu'
                   and a.dtype in (np.float16, np.float32) for a in arrays) or \
                sum(a.size for a in arrays) > _HOST_CHECK_MAX_ELEMENTS:
            return None
        n = len(arrays)
        return ((ctypes.c_void_p * n)(*[a.handle.value for a in arrays]),
                (ctypes.c_int64 * n)(*[a.size for a in arrays]),
                (ctypes.c_int * n)(*[int(a.dtype == np.float16) for a in arrays]))
    return _identity.kept(cache, ('host_all_finite', len(arrays), id(arrays[0])), arrays, build)


def host_all_finite(function: Any, prepared: tuple) -> Optional[bool]:
    """Run the native library's ``mx_lbsgd_host_all_finite`` (a ctypes function) on the
    arrays of `prepared` (`host_check_arrays`): it waits for each array through
    ``MXNDArrayWaitToRead``, takes its data pointer with ``MXNDArrayGetData`` and tests the
    bits on the calling thread. None when an array has no storage.

    Why: an engine operator followed by a host read costs two thread wake-ups (about 0.1
    ms on this CPU; the whole loss-scaled step of a small model is 0.6-0.8 ms); the
    functions are MXNet 1.9.1's C API (``include/mxnet/c_api.h``), handed over as pointers
    because the library does not link MXNet."""
    import ctypes
    from mxnet.base import _LIB, check_call
    handles, sizes, half = prepared
    result = function(ctypes.c_int(len(sizes)), handles, sizes, half,
                      ctypes.cast(_LIB.MXNDArrayWaitToRead, ctypes.c_void_p),
                      ctypes.cast(_LIB.MXNDArrayGetData, ctypes.c_void_p))
    if result == -2:            # an array without storage: the operator handles it
        return None
    if result < 0:
        check_call(result)      # raises MXNet's error (e.g. one of the computing operator)
    return bool(result)
