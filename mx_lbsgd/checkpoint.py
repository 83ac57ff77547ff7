"""Atomic, validated checkpoints of optimizer states for gluon Trainers and Modules.

MXNet writes `Trainer.save_states` and `Module.save_checkpoint` files in place, so a process
killed mid-save leaves a truncated file and loading it fails deep inside pickle. These
functions write to a temporary file in the same folder, fsync it and rename it over the
target (atomic on POSIX; a killed save may leave a hidden `.NAME.*` temporary file, never a
half-written NAME), and check a file before loading it.

What a file holds: the per-parameter states of every device (momentum, fp32 master copies,
accumulators: before a window is reduced they differ between devices, and MXNet's own
``Trainer.save_states`` keeps only the first device's), and the optimizer's progress: the
update counters, ``num_update``, the learning rate and its scheduler and, for mx_lbsgd's
optimizers, the accumulation window and the loss scaler. Loading puts all of it into the
live optimizer, so objects that hold its scaler keep seeing the live one. Files written by
MXNet's ``save_states``/``save_optimizer_states`` and by mx_lbsgd 0.1 load too.
"""
import os
import pickle
import tempfile

import mxnet as mx

from . import _compat
from .lbsgd import _Ledger

__all__ = ['save_states', 'load_states', 'save_checkpoint']

_FORMAT = 'mx_lbsgd.states'
_VERSION = 2


def _atomic_write(path, write):
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


def _updaters(target):
    """The Updaters that hold `target`'s states (one per device for a Trainer)."""
    if isinstance(target, mx.gluon.Trainer):
        _compat.init_trainer_params(target)
        return _compat.trainer_updaters(target), target.optimizer
    if isinstance(target, mx.module.BaseModule):
        updater = _compat.module_updater(target)
        if updater is None:
            kvstore, _ = _compat.module_kvstore(target)
            updater = getattr(kvstore, '_updater', None)
        if updater is None:
            raise ValueError('this Module updates its weights on a distributed kvstore: '
                             'its optimizer states live on the servers and cannot be saved')
        return [updater], _compat.module_optimizer(target)
    raise TypeError('target must be a gluon.Trainer or a Module; got %r' % (target,))


def _progress(opt):
    """Counters, lr and scheduler of any MXNet optimizer, plus mx_lbsgd's own progress."""
    progress = {'index_update_counts': {k: dict(v) for k, v in
                                        opt._all_index_update_counts.items()},
                'num_update': opt.num_update, 'lr': opt.lr, 'lr_scheduler': opt.lr_scheduler}
    if hasattr(opt, 'progress'):
        progress.update(opt.progress())
    return progress


def _load_progress(opt, progress):
    opt.lr = progress.get('lr', opt.lr)
    opt.lr_scheduler = progress.get('lr_scheduler', opt.lr_scheduler)
    if hasattr(opt, 'load_progress'):
        opt.load_progress(dict({'skipped_updates': 0}, **progress))
        return
    opt._all_index_update_counts = {k: dict(v) for k, v in
                                    progress['index_update_counts'].items()} or {0: {}}
    opt._index_update_count = opt._all_index_update_counts.setdefault(0, {})
    opt.num_update = progress['num_update']


def save_states(target, path):
    """Atomically write the optimizer states (every device) and progress of a gluon.Trainer
    or a Module to `path`."""
    updaters, opt = _updaters(target)
    blob = pickle.dumps({'format': _FORMAT, 'version': _VERSION,
                         'states': [u.states for u in updaters],
                         'progress': _progress(opt)}, protocol=pickle.HIGHEST_PROTOCOL)
    _atomic_write(path, lambda tmp: _write_bytes(tmp, blob))


def _write_bytes(path, blob):
    with open(path, 'wb') as f:
        f.write(blob)


def _read(path):
    """(per-device states, progress or None) of any supported file, checked."""
    try:
        with open(path, 'rb') as f:
            blob = f.read()
    except OSError as err:
        raise ValueError('cannot read optimizer states %r: %s' % (path, err)) from None
    try:
        content = pickle.loads(blob)
    except Exception as err:   # truncated or corrupted: any unpickling error
        raise ValueError('optimizer states file %r (%d bytes) is truncated or corrupted '
                         '(%s: %s); load an earlier checkpoint or start from fresh optimizer '
                         'states' % (path, len(blob), type(err).__name__, err)) from None
    optimizer = None
    if isinstance(content, dict) and content.get('format') == _FORMAT:
        return content['states'], content['progress']
    if isinstance(content, tuple) and len(content) == 2:       # Trainer.save_states
        content, optimizer = content
    if not isinstance(content, dict):
        raise ValueError('%r is not an optimizer states file (it holds a %s)'
                         % (path, type(content).__name__))
    states, progress = _strip_ledgers(content)
    if progress is None and optimizer is not None:
        progress = _progress(optimizer)
    return [states], progress


def _strip_ledgers(states):
    """mx_lbsgd 0.1 ended every state with a reference to its optimizer: drop it, keep
    the optimizer's progress."""
    progress = None
    clean = {}
    for key, state in states.items():
        if isinstance(state, tuple) and state and isinstance(state[-1], _Ledger):
            if progress is None and state[-1].opt is not None:
                progress = _progress(state[-1].opt)
            state = state[:-1]
            state = state[0] if len(state) == 1 else state
        clean[key] = state
    return clean, progress


def load_states(target, path):
    """Check `path`, then load it into a gluon.Trainer or a Module. A truncated or
    corrupted file raises ValueError before anything changes."""
    device_states, progress = _read(path)
    updaters, opt = _updaters(target)
    for k, updater in enumerate(updaters):
        states = device_states[k] if k < len(device_states) else device_states[0]
        updater.states = dict(states) if k == 0 else pickle.loads(pickle.dumps(states))
        updater.states_synced = dict.fromkeys(updater.states, False)
    if progress is not None:
        _load_progress(opt, progress)


def save_checkpoint(mod, prefix, epoch, save_optimizer_states=True):
    """`Module.save_checkpoint`, with every file written atomically:
    prefix-symbol.json, prefix-%04d.params and (optionally) prefix-%04d.states."""
    _atomic_write('%s-symbol.json' % prefix, mod.symbol.save)
    _atomic_write('%s-%04d.params' % (prefix, epoch), mod.save_params)
    if save_optimizer_states:
        save_states(mod, '%s-%04d.states' % (prefix, epoch))
