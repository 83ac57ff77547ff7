"""Atomic, checksummed, safely loaded checkpoints of optimizer states (Trainer, Module).

MXNet writes `Trainer.save_states` and `Module.save_checkpoint` files in place, so a process
killed mid-save leaves a truncated file and loading it fails deep inside pickle. These
functions write to a temporary file in the same folder, fsync it and rename it over the
target (atomic on POSIX; a killed save may leave a hidden `.NAME.*` temporary file, never a
half-written NAME), and check a file before loading it.

What a file holds: the per-parameter states of every device (momentum, fp32 master copies,
accumulators: before a window is reduced they differ between devices, and MXNet's own
``Trainer.save_states`` keeps only the first device's), and the optimizer's progress: the
update counters (which also say where an accumulation window is), ``num_update``, the
learning rate and its scheduler and, for mx_lbsgd's optimizers, the loss scaler; for a
Trainer with a `LossScaling` hook, the hook's scaler too. Loading puts all of it into the
live objects, so code that holds a scaler keeps seeing the live one. Files written by
MXNet's ``save_states``/``save_optimizer_states`` and by mx_lbsgd 0.1 load too.

Safety: a file is read with a restricted unpickler (`_Unpickler`) that accepts MXNet
NDArrays, builtin containers and scalars, numpy arrays/scalars/dtypes, MXNet's optimizers and
LR schedulers and this package's optimizer, scaler and scheduler classes, and refuses every
other global (functions, ``os.system``, ``eval``, ``builtins.__import__``, ...) with a
ValueError naming it, before anything runs. ``trusted=True`` unpickles without restriction,
for files you wrote yourself that hold other types (a custom LR scheduler, a callable
``lars_exclude``). Pickle is kept, not replaced by a new format, because MXNet's own
``save_states`` files are pickles that must keep loading, and one reader serves both.

Integrity: files written here start with ``MX_LBSGD_MAGIC`` and the SHA-256 of the rest,
checked before unpickling: a flipped bit or a truncation anywhere gives "corrupted; load an
earlier checkpoint". The magic begins with a tiny pickle program that calls
`_refuse_plain_unpickling`, so MXNet's own ``Trainer.load_states`` (or
``Module.load_optimizer_states``, or ``pickle.load``) on such a file raises a ValueError that
names this module's loader instead of "pickle data was truncated"; that function only
raises, and this module's reader strips the magic before it unpickles anything. Files
written before that header existed (magic ``MXLBSGD-STATES\x00\x02``) load as before.
``save_checkpoint`` writes a ``.sha256`` sidecar next to the symbol and params files
(MXNet's formats, which MXNet's loaders read as they are); `load_checkpoint` checks them.
Loading validates every state against the target's parameters (keys, layout, shapes,
dtypes) and the scaler states before it changes anything.
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import tempfile
import warnings
from typing import IO, TYPE_CHECKING, Any, Callable, Dict, List, NoReturn, Optional, Tuple, Union

import numpy as np
import mxnet as mx

from . import _compat, _legacy
from .loss_scaling import DynamicLossScaler
from .gluon import binding as _binding
from .pipeline.batch_choice import BatchChoiceState
from .pipeline.lr_scaling import LrScalingState

if TYPE_CHECKING:
    from .gluon import LossScaling

#: What the functions here save and load: a gluon.Trainer or a (bound) Module.
_Target = Union['mx.gluon.Trainer', 'mx.module.BaseModule']
#: A file path (str or pathlib.Path).
_Path = Union[str, 'os.PathLike[str]']
#: Per device, parameter index (or name) -> that parameter's optimizer state; and the progress.
_States = Tuple[List[Dict[Any, Any]], Optional[Dict[str, Any]]]

__all__ = ['save_states', 'load_states', 'save_checkpoint', 'load_checkpoint']

_FORMAT = 'mx_lbsgd.states'
_VERSION = 2
# A file starts with a pickle program that calls `_refuse_plain_unpickling`, so that a plain
# unpickler (MXNet's Trainer.load_states, Module.load_optimizer_states, pickle.load) stops
# with its message instead of "pickle data was truncated"; then a tag, the SHA-256 of the
# rest, and the pickled content. Earlier files started with the tag's version 2 alone.
_PLAIN_PICKLE_STOP = b'cmx_lbsgd.checkpoint\n_refuse_plain_unpickling\n)R'
_TAG = b'MXLBSGD-STATES\x00\x03'
MX_LBSGD_MAGIC = _PLAIN_PICKLE_STOP + _TAG
_MAGIC_V2 = b'MXLBSGD-STATES\x00\x02'
_DIGEST = 32


def _refuse_plain_unpickling() -> NoReturn:
    """What a plain unpickler runs when it reads an mx_lbsgd states file (the file's first
    bytes call it): it only raises, naming the loader. Keep its name: files refer to it."""
    raise ValueError(
        'this is an mx_lbsgd optimizer states file (written by mx_lbsgd.checkpoint.save_states'
        '): a checksum header precedes its content, so MXNet\'s Trainer.load_states, '
        'Module.load_optimizer_states and pickle cannot read it. Load it with '
        'mx_lbsgd.checkpoint.load_states(trainer_or_module, path)')


def _allowed_globals() -> set[tuple[str, str]]:
    allowed = {('mxnet.ndarray.ndarray', 'NDArray'), ('mxnet.numpy', 'ndarray'),
               ('mxnet.numpy.multiarray', 'ndarray'),
               ('numpy', 'ndarray'), ('numpy', 'dtype'),
               ('numpy.core.multiarray', '_reconstruct'), ('numpy.core.multiarray', 'scalar'),
               ('numpy._core.multiarray', '_reconstruct'), ('numpy._core.multiarray', 'scalar'),
               ('collections', 'OrderedDict'), ('copyreg', '_reconstructor'),
               ('builtins', 'object'), ('builtins', 'set'), ('builtins', 'frozenset'),
               ('builtins', 'slice'), ('builtins', 'complex'), ('builtins', 'bytearray'),
               ('_codecs', 'encode'),
               ('mx_lbsgd.loss_scale', 'DynamicLossScaler'),     # before 0.2
               ('mx_lbsgd.loss_scaling.scaler', 'DynamicLossScaler'),
               ('mx_lbsgd.lr_scheduler', 'WarmupScheduler')}
    # every registered optimizer (mx_lbsgd's register themselves on import)
    optimizers = set(mx.optimizer.Optimizer.opt_registry.values())
    optimizers |= {cls for cls in vars(mx.optimizer.optimizer).values()   # MXNet's LBSGD,
                   if isinstance(cls, type) and issubclass(cls, mx.optimizer.Optimizer)}
    for cls in optimizers:                                 # which ours replaced as 'lbsgd'
        allowed.add((cls.__module__, cls.__name__))
    for name in ('LRScheduler', 'FactorScheduler', 'MultiFactorScheduler', 'PolyScheduler',
                 'CosineScheduler'):
        allowed.add(('mxnet.lr_scheduler', name))
    return allowed


class _Unpickler(pickle.Unpickler):
    """Reads earlier versions' names (`_legacy.GLOBALS`); unless `trusted`, resolves only the
    globals of `_allowed_globals` and refuses anything else before it could be called."""

    def __init__(self, file: IO[bytes], trusted: bool) -> None:
        super().__init__(file)
        self.trusted = trusted

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _legacy.GLOBALS:
            return _legacy.GLOBALS[module, name]
        if self.trusted or (module, name) in _allowed_globals():
            return super().find_class(module, name)
        raise _Refused('%s.%s' % (module, name))


class _Refused(pickle.UnpicklingError):
    pass


def _unpickle(blob: bytes, path: _Path, trusted: bool) -> Any:
    try:
        return _Unpickler(io.BytesIO(blob), trusted).load()
    except _Refused as err:
        raise ValueError(
            'optimizer states file %r refers to %s, which is not an allowed type, so it was '
            'not loaded (loading it could run code). If you trust the file, load it with '
            'mx_lbsgd.checkpoint.load_states(target, path, trusted=True)' % (path, err)) from None
    except Exception as err:   # truncated or corrupted: any unpickling error
        raise ValueError('optimizer states file %r (%d bytes) is truncated or corrupted '
                         '(%s: %s); load an earlier checkpoint or start from fresh optimizer '
                         'states' % (path, len(blob), type(err).__name__, err)) from None


def _atomic_write(path: _Path, write: Callable[[str], object]) -> None:
    """Calls write(tmp_path), then renames tmp_path over `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix='.' + os.path.basename(path) + '.', dir=folder)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, 'rb+') as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)         # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _updaters(target: _Target) -> tuple[list[mx.optimizer.Updater], mx.optimizer.Optimizer]:
    """The Updaters that hold `target`'s states (one per device for a Trainer)."""
    if isinstance(target, mx.gluon.Trainer):
        _compat.init_trainer_params(target)
        return _compat.trainer_updaters(target), target.optimizer
    if isinstance(target, mx.module.BaseModule):
        updater = _compat.module_updater(target)
        if updater is None:
            kvstore, _ = _compat.module_kvstore(target)
            updater = _compat.kvstore_updater(kvstore)
        if updater is None:
            raise ValueError('this Module updates its weights on a distributed kvstore: '
                             'its optimizer states live on the servers and cannot be saved')
        return [updater], _compat.module_optimizer(target)
    raise TypeError('target must be a gluon.Trainer or a Module; got %r' % (target,))


def _progress(opt: mx.optimizer.Optimizer) -> dict[str, Any]:
    """One dict of plain values: the counters, lr and scheduler of any MXNet optimizer, then
    what an mx_lbsgd optimizer adds through its ``progress()`` (the protocol the optimizers
    and this module share: ``progress()`` / ``load_progress(progress)``)."""
    counts, _ = _compat.update_counts(opt)
    progress = {'index_update_counts': {k: dict(v) for k, v in counts.items()},
                'num_update': opt.num_update, 'lr': opt.lr, 'lr_scheduler': opt.lr_scheduler}
    if hasattr(opt, 'progress'):
        progress.update(opt.progress())
    return progress


def _load_progress(opt: mx.optimizer.Optimizer, progress: dict[str, Any]) -> None:
    opt.lr = progress.get('lr', opt.lr)
    opt.lr_scheduler = progress.get('lr_scheduler', opt.lr_scheduler)
    if hasattr(opt, 'load_progress'):
        opt.load_progress(progress)
    else:
        _compat.set_update_counts(opt, progress['index_update_counts'])
        opt.num_update = progress['num_update']


def save_states(target: _Target, path: _Path) -> None:
    """Atomically write the optimizer states (every device) and progress of a gluon.Trainer
    or a Module to `path`.

    Parameters
    ----------
    target : gluon.Trainer or Module
        A Module must be bound, with its optimizer initialized.
    path : str or os.PathLike

    Raises
    ------
    TypeError
        `target` is neither a gluon.Trainer nor a Module.
    ValueError
        A Module that updates on a distributed kvstore (its states live on the servers).

    Examples
    --------
    >>> import os, tempfile
    >>> import mxnet as mx
    >>> from mxnet import autograd, gluon, nd
    >>> from mx_lbsgd import checkpoint
    >>> net = gluon.nn.Dense(1, in_units=2)
    >>> net.initialize(mx.init.One())
    >>> trainer = gluon.Trainer(net.collect_params(), 'lbsgd', {'momentum': 0.9})
    >>> with autograd.record():
    ...     loss = net(nd.array([[1.0, 2.0]])).sum()
    >>> loss.backward()
    >>> trainer.step(1)
    >>> folder = tempfile.TemporaryDirectory()
    >>> path = os.path.join(folder.name, 'run.states')
    >>> checkpoint.save_states(trainer, path)
    >>> os.listdir(folder.name)          # no temporary file left behind
    ['run.states']
    >>> folder.cleanup()
    """
    updaters, opt = _updaters(target)
    progress = _progress(opt)
    hook = _loss_scaling(target)
    if hook is not None:
        progress['loss_scaling'] = hook.scaler.state_dict()
    payload = pickle.dumps({'format': _FORMAT, 'version': _VERSION,
                            'states': [u.states for u in updaters],
                            'progress': progress}, protocol=pickle.HIGHEST_PROTOCOL)
    blob = MX_LBSGD_MAGIC + hashlib.sha256(payload).digest() + payload
    _atomic_write(path, lambda tmp: _write_bytes(tmp, blob))


def _write_bytes(path: str, blob: bytes) -> None:
    with open(path, 'wb') as f:
        f.write(blob)


def _read(path: _Path, trusted: bool = False) -> _States:
    """(per-device states, progress or None) of any supported file, checked."""
    content = _unpickle(_checked_payload(_read_bytes(path), path), path, trusted)
    if isinstance(content, dict) and content.get('format') == _FORMAT:
        return _current_states(content, path)
    return _older_states(content, path)


def _read_bytes(path: _Path) -> bytes:
    """The bytes of the file at `path`; ValueError for a folder, an unreadable or an empty
    file, FileNotFoundError for a missing one."""
    if os.path.isdir(path):
        raise ValueError('optimizer states path %r is a directory, not a states file' % path)
    try:
        with open(path, 'rb') as f:
            blob = f.read()
    except FileNotFoundError:
        raise FileNotFoundError('optimizer states file %r does not exist' % path) from None
    except OSError as err:
        raise ValueError('cannot read optimizer states %r: %s' % (path, err)) from None
    if not blob:
        raise ValueError('optimizer states file %r is empty; load an earlier checkpoint'
                         % path)
    return blob


def _checked_payload(blob: bytes, path: _Path) -> bytes:
    """What follows this package's header and checksum once the checksum matches (the
    content of an earlier version's file or of MXNet's: `blob` itself)."""
    magic = next((m for m in (MX_LBSGD_MAGIC, _MAGIC_V2) if blob.startswith(m)), None)
    if magic is None and _damaged_header(blob):
        magic = MX_LBSGD_MAGIC           # the checksum then says "corrupted"
    if magic is not None:
        digest = blob[len(magic):len(magic) + _DIGEST]
        payload = blob[len(magic) + _DIGEST:]
        if not blob.startswith(magic) or hashlib.sha256(payload).digest() != digest:
            raise ValueError('optimizer states file %r is corrupted (its SHA-256 does not '
                             'match: truncated or changed since it was written); load an '
                             'earlier checkpoint' % path)
        blob = payload
    return blob


def _current_states(content: dict[str, Any], path: _Path) -> _States:
    """The states and progress of a file written by `save_states`, checked."""
    states, progress = content.get('states'), content.get('progress')
    if not (isinstance(states, list) and states and isinstance(progress, dict)
            and all(isinstance(d, dict) for d in states)):
        raise ValueError('%r is not a valid mx_lbsgd states file (malformed content)'
                         % path)
    return states, progress


def _older_states(content: Any, path: _Path) -> _States:
    """The states and progress of a file written by MXNet's ``save_states`` /
    ``save_optimizer_states`` or by mx_lbsgd 0.1, checked."""
    optimizer = None
    if isinstance(content, tuple) and len(content) == 2:       # Trainer.save_states
        content, optimizer = content
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise ValueError('%r is not an optimizer states file (it holds a pair whose '
                             'second item is a %s, not an optimizer)'
                             % (path, type(optimizer).__name__))
    if not isinstance(content, dict):
        raise ValueError('%r is not an optimizer states file (it holds a %s; expected a '
                         'dict of per-parameter states)' % (path, type(content).__name__))
    states, progress = _legacy.strip_ledgers(content, _progress)
    if progress is None and optimizer is not None:
        progress = _progress(optimizer)
    return [states], progress


def _damaged_header(blob: bytes) -> bool:
    """Whether `blob` starts as this package's header with a byte changed or cut short."""
    stop = len(_PLAIN_PICKLE_STOP)
    return (blob[:stop] == _PLAIN_PICKLE_STOP or blob[stop:len(MX_LBSGD_MAGIC)] == _TAG
            or (len(blob) < len(MX_LBSGD_MAGIC) and MX_LBSGD_MAGIC.startswith(blob)))


def load_states(target: _Target, path: _Path, trusted: bool = False) -> None:
    """Check `path`, then load it into a gluon.Trainer or a Module. A missing file raises
    FileNotFoundError; any other problem (corrupted, not a states file, types outside the
    allowlist without ``trusted=True``, states that do not fit the target's parameters)
    raises ValueError before anything changes.

    Parameters
    ----------
    target : gluon.Trainer or Module
        For a Trainer with a `LossScaling` hook, create the hook first: its scaler state
        is loaded too.
    path : str or os.PathLike
        A file of `save_states`, of MXNet's ``Trainer.save_states`` or
        ``Module.save_optimizer_states``, or of mx_lbsgd 0.1.
    trusted : bool, default False
        Unpickle without the allowlist (only for files you wrote yourself).

    Raises
    ------
    FileNotFoundError
        `path` does not exist.
    ValueError
        Anything else wrong with the file or its fit (see above).
    TypeError
        `target` is neither a gluon.Trainer nor a Module.

    Examples
    --------
    >>> import os, tempfile
    >>> import mxnet as mx
    >>> from mxnet import autograd, gluon, nd
    >>> from mx_lbsgd import checkpoint
    >>> net = gluon.nn.Dense(1, in_units=2)
    >>> net.initialize(mx.init.One())
    >>> trainer = gluon.Trainer(net.collect_params(), 'lbsgd', {'momentum': 0.9})
    >>> with autograd.record():
    ...     loss = net(nd.array([[1.0, 2.0]])).sum()
    >>> loss.backward()
    >>> trainer.step(1)
    >>> folder = tempfile.TemporaryDirectory()
    >>> path = os.path.join(folder.name, 'run.states')
    >>> checkpoint.save_states(trainer, path)
    >>> resumed = gluon.Trainer(net.collect_params(), 'lbsgd', {'momentum': 0.9})
    >>> checkpoint.load_states(resumed, path)
    >>> resumed.optimizer.num_update, resumed.optimizer.micro_batches
    (1, 1)

    States that do not fit (no momentum buffer without momentum) are refused:

    >>> other = gluon.Trainer(net.collect_params(), 'lbsgd', {'momentum': 0.0})
    >>> checkpoint.load_states(other, path)
    Traceback (most recent call last):
    ...
    ValueError: optimizer states file '...run.states' does not fit this LBSGD for parameter ...
    >>> folder.cleanup()
    """
    device_states, progress = _read(path, trusted)
    updaters, opt = _updaters(target)
    weights = _weights_by_key(target)
    chosen = []
    for k, updater in enumerate(updaters):
        states = device_states[k] if k < len(device_states) else device_states[0]
        for key, state in states.items():
            _check_state(path, opt, key, state, weights[k].get(key))
        chosen.append(states)
    if progress is not None:
        _check_progress(path, progress)
        try:
            getattr(opt, 'check_progress', lambda saved: None)(progress)
        except ValueError as err:
            raise ValueError('optimizer states file %r: %s' % (path, err)) from None
    for k, (updater, states) in enumerate(zip(updaters, chosen)):
        updater.states = dict(states) if k == 0 else pickle.loads(pickle.dumps(states))
        updater.states_synced = dict.fromkeys(updater.states, False)
    if progress is not None:
        _load_progress(opt, progress)
        _load_loss_scaling(target, path, progress.get('loss_scaling'))


def _loss_scaling(target: _Target) -> LossScaling | None:
    """The `LossScaling` hook attached to a Trainer target, or None."""
    if isinstance(target, mx.gluon.Trainer):
        return _binding.loss_scaling_of(target)
    return None


def _load_loss_scaling(target: _Target, path: _Path, state: dict[str, Any] | None) -> None:
    """Put a saved hook scaler state into the live hook's scaler object."""
    if state is None:
        return
    hook = _loss_scaling(target)
    if hook is None:
        warnings.warn('optimizer states file %r holds the scaler state of a LossScaling hook, '
                      'and no hook is attached to this Trainer: create the LossScaling hook '
                      'before load_states to resume its loss scale' % path, RuntimeWarning)
        return
    hook.scaler.load_state_dict(state)


def _weights_by_key(target: _Target) -> list[dict[Any, mx.nd.NDArray]]:
    """Per updater: state key -> the weight array it belongs to."""
    if isinstance(target, mx.gluon.Trainer):
        params = _compat.trainer_params(target)
        return [{i: _compat.legacy(p.list_data()[k]) for i, p in enumerate(params)
                 if p.grad_req != 'null'} for k in range(len(_compat.trainer_updaters(target)))]
    arrays, names = _compat.module_param_arrays(target)
    n = len(arrays[0]) if arrays else 1
    by_key: dict[Any, mx.nd.NDArray] = {}       # parameter name and index -> weight
    for i, (name, per_device) in enumerate(zip(names, arrays)):
        by_key[name] = per_device[0]
        for k, array in enumerate(per_device):
            by_key[i * n + k] = array
    return [by_key]


def _leaves(state: Any) -> list[Any]:
    """The arrays (or None) of a state, nested tuples flattened: MXNet's multi-precision
    states nest, e.g. LAMB/Adam's ``(weight_fp32, (mean, var))``."""
    if not isinstance(state, tuple):
        return [state]
    return [leaf for part in state for leaf in _leaves(part)]


def _arrays_of(state: Any) -> list[Any] | tuple[tuple[int, ...], str] | None:
    """(shape, dtype) of each array of a state, nested as the state is."""
    if isinstance(state, tuple):
        return [_arrays_of(part) for part in state]
    return None if state is None else (tuple(state.shape), np.dtype(state.dtype).name)


def _check_state(path: _Path, opt: mx.optimizer.Optimizer, key: Any, state: Any,
                 weight: mx.nd.NDArray | None) -> None:
    if weight is None:
        raise ValueError('optimizer states file %r has a state for parameter %r, which the '
                         'target does not have (a different model or parameter order?)'
                         % (path, key))
    if not all(p is None or isinstance(p, mx.nd.NDArray) for p in _leaves(state)):
        raise ValueError('optimizer states file %r: the state of parameter %r holds %r, '
                         'not NDArrays' % (path, key, state))
    expected = _arrays_of(opt.create_state_multi_precision(key, weight))
    got = _arrays_of(state)
    if got != expected:
        raise ValueError(
            'optimizer states file %r does not fit this %s for parameter %r: it holds '
            '%s, this optimizer needs %s (shape, dtype; None: no array). It was written for '
            'another optimizer configuration or model; use matching settings or start from '
            'fresh optimizer states (states of MXNet\'s SGD/LBSGD fit lbsgd with '
            'batch_scale=1 and the same momentum and multi_precision)'
            % (path, type(opt).__name__, key, got, expected))


def _check_progress(path: _Path, progress: dict[str, Any]) -> None:
    counts = progress.get('index_update_counts')
    if not isinstance(counts, dict) or not isinstance(progress.get('num_update'), int):
        raise ValueError('optimizer states file %r has malformed progress counters' % path)
    for key in ('loss_scaler', 'loss_scaling'):
        if progress.get(key) is not None:
            try:       # on a throwaway scaler: the live one changes only once all is checked
                DynamicLossScaler().load_state_dict(progress[key])
            except (ValueError, TypeError) as err:
                raise ValueError('optimizer states file %r has a malformed loss scaler state '
                                 '(%s)' % (path, err)) from None
    if progress.get('lr_scaling') is not None:
        try:
            LrScalingState.from_dict(progress['lr_scaling'])
            window = progress.get('lr_scaling_window')
            if window is not None:
                devices, pairs = window
                if not isinstance(devices, int) or not all(
                        isinstance(v, float) and isinstance(f, float) for v, f in pairs):
                    raise TypeError('window norms %r' % (window,))
            previous = progress.get('lr_scaling_previous')
            if previous is not None:
                square, buffers = previous
                if not isinstance(square, float) or not all(
                        isinstance(b, mx.nd.NDArray) and b.dtype == np.float32 for b in buffers):
                    raise TypeError('previous gradient %r' % (type(previous),))
        except (ValueError, TypeError, AttributeError) as err:
            raise ValueError('optimizer states file %r has a malformed lr_scaling state (%s)'
                             % (path, err)) from None
    if progress.get('batch_choice') is not None:
        try:
            BatchChoiceState.from_dict(progress['batch_choice'])
        except (ValueError, TypeError, AttributeError, KeyError) as err:
            raise ValueError("optimizer states file %r has a malformed batch_scale='auto' "
                             'state (%s)' % (path, err)) from None


def save_checkpoint(mod: mx.module.Module, prefix: str, epoch: int,
                    save_optimizer_states: bool = True) -> None:
    """`Module.save_checkpoint`, with every file written atomically:
    prefix-symbol.json, prefix-%04d.params (each with a .sha256 sidecar) and (optionally)
    prefix-%04d.states.

    Parameters
    ----------
    mod : Module
        Bound, its parameters (and, to save them, its optimizer) initialized.
    prefix : str
        Path prefix of the files.
    epoch : int
    save_optimizer_states : bool, default True
        Also write the optimizer states with `save_states`.

    Examples
    --------
    >>> import os, tempfile
    >>> import mxnet as mx
    >>> from mx_lbsgd import checkpoint
    >>> sym = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(
    ...     mx.sym.Variable('data'), num_hidden=2, name='fc'), name='softmax')
    >>> mod = mx.mod.Module(sym, context=mx.cpu())
    >>> mod.bind(data_shapes=[('data', (4, 3))], label_shapes=[('softmax_label', (4,))])
    >>> mod.init_params(mx.init.Zero())
    >>> mod.init_optimizer(optimizer='lbsgd', optimizer_params={'momentum': 0.9})
    >>> folder = tempfile.TemporaryDirectory()
    >>> checkpoint.save_checkpoint(mod, os.path.join(folder.name, 'model'), 3)
    >>> for name in sorted(os.listdir(folder.name)):
    ...     print(name)
    model-0003.params
    model-0003.params.sha256
    model-0003.states
    model-symbol.json
    model-symbol.json.sha256
    >>> folder.cleanup()
    """
    for name, write in (('%s-symbol.json' % prefix, mod.symbol.save),
                        ('%s-%04d.params' % (prefix, epoch), mod.save_params)):
        _atomic_write(name, write)
        with open(name, 'rb') as f:
            digest = hashlib.sha256(f.read()).hexdigest()

        def write_sidecar(tmp: str) -> None:       # called right away: this name's digest
            _write_bytes(tmp, ('%s  %s\n' % (digest, os.path.basename(name))).encode())
        _atomic_write(name + '.sha256', write_sidecar)
    if save_optimizer_states:
        save_states(mod, '%s-%04d.states' % (prefix, epoch))


def load_checkpoint(prefix: str, epoch: int
                    ) -> tuple[mx.sym.Symbol, dict[str, mx.nd.NDArray], dict[str, mx.nd.NDArray]]:
    """`mx.model.load_checkpoint` after checking the .sha256 sidecars that
    `save_checkpoint` wrote: (symbol, arg_params, aux_params).

    Parameters
    ----------
    prefix : str
    epoch : int

    Returns
    -------
    tuple
        ``(symbol, arg_params, aux_params)``, as ``mx.model.load_checkpoint`` returns them.
        Optimizer states: ``load_states(mod, '%s-%04d.states' % (prefix, epoch))`` once the
        Module is bound.

    Raises
    ------
    FileNotFoundError
        The symbol or params file is missing.
    ValueError
        A sidecar is missing or unreadable, or a file does not match its SHA-256.

    Examples
    --------
    >>> import os, tempfile
    >>> import mxnet as mx
    >>> from mx_lbsgd import checkpoint
    >>> sym = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(
    ...     mx.sym.Variable('data'), num_hidden=2, name='fc'), name='softmax')
    >>> mod = mx.mod.Module(sym, context=mx.cpu())
    >>> mod.bind(data_shapes=[('data', (4, 3))], label_shapes=[('softmax_label', (4,))])
    >>> mod.init_params(mx.init.Zero())
    >>> folder = tempfile.TemporaryDirectory()
    >>> prefix = os.path.join(folder.name, 'model')
    >>> checkpoint.save_checkpoint(mod, prefix, 3, save_optimizer_states=False)
    >>> symbol, arg_params, aux_params = checkpoint.load_checkpoint(prefix, 3)
    >>> sorted(arg_params), aux_params
    (['fc_bias', 'fc_weight'], {})

    A changed byte is caught before MXNet reads the file:

    >>> with open(prefix + '-0003.params', 'r+b') as f:
    ...     _ = f.seek(-1, os.SEEK_END)
    ...     _ = f.write(b'!')
    >>> checkpoint.load_checkpoint(prefix, 3)
    Traceback (most recent call last):
    ...
    ValueError: checkpoint file '...model-0003.params' is corrupted (its SHA-256 does not ...
    >>> folder.cleanup()
    """
    for name in ('%s-symbol.json' % prefix, '%s-%04d.params' % (prefix, epoch)):
        if not os.path.exists(name):
            raise FileNotFoundError('checkpoint file %r does not exist' % name)
        try:
            with open(name + '.sha256') as f:
                expected = f.read().split()[0]
        except (OSError, IndexError):
            raise ValueError('checkpoint file %r has no readable .sha256 sidecar; it was not '
                             'written by mx_lbsgd.checkpoint.save_checkpoint' % name) from None
        with open(name, 'rb') as f:
            if hashlib.sha256(f.read()).hexdigest() != expected:
                raise ValueError('checkpoint file %r is corrupted (its SHA-256 does not '
                                 'match the sidecar); load an earlier checkpoint' % name)
    return mx.model.load_checkpoint(prefix, epoch)
