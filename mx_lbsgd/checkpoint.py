"""Atomic, validated checkpoints for gluon Trainers and Modules.

MXNet writes `Trainer.save_states` and `Module.save_checkpoint` files in place, so a process
killed mid-save leaves a truncated file and loading it fails deep inside pickle. These
functions write to a temporary file in the same folder, fsync it and rename it over the
target (atomic on POSIX; a killed save may leave a hidden `.NAME.*` temporary file, never a
half-written NAME), and check a file before loading it. The files stay MXNet's own
format: `trainer.load_states` / `mod.load_optimizer_states` read them too.

What survives: the per-parameter states (momentum, fp32 master copies, accumulators) and,
for mx_lbsgd's optimizers, the warmup/accumulation counters, `num_update` and the loss
scaler's state (pickled with the Trainer's optimizer, or carried by the states' ledger for
Module, which saves the states without the optimizer).
"""
import os
import pickle
import tempfile

import mxnet as mx

from . import _graph_scale

__all__ = ['save_states', 'load_states', 'save_checkpoint']


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


def _check_states_file(path):
    try:
        with open(path, 'rb') as f:
            blob = f.read()
    except OSError as err:
        raise ValueError('cannot read optimizer states %r: %s' % (path, err)) from None
    served = dict(_graph_scale._SCALERS)
    try:
        states = pickle.loads(blob)      # unpickling serves the file's scaler: undo that
    except Exception as err:   # truncated or corrupted: any unpickling error
        raise ValueError('optimizer states file %r (%d bytes) is truncated or corrupted '
                         '(%s: %s); load an earlier checkpoint or start from fresh optimizer '
                         'states' % (path, len(blob), type(err).__name__, err)) from None
    finally:
        _graph_scale._SCALERS.clear()
        _graph_scale._SCALERS.update(served)
    optimizer = None
    if isinstance(states, tuple) and len(states) == 2:
        states, optimizer = states
    if not isinstance(states, dict):
        raise ValueError('%r is not an MXNet optimizer states file (it holds a %s)'
                         % (path, type(states).__name__))
    return states, optimizer


def save_states(target, path):
    """Atomically write the optimizer states of a gluon.Trainer or a Module to `path`."""
    if isinstance(target, mx.gluon.Trainer):
        _atomic_write(path, target.save_states)
    elif isinstance(target, mx.module.BaseModule):
        _atomic_write(path, target.save_optimizer_states)
    else:
        raise TypeError('target must be a gluon.Trainer or a Module; got %r' % (target,))


def load_states(target, path):
    """Check `path`, then load it into a gluon.Trainer or a Module. A truncated or corrupted
    file raises ValueError before anything changes."""
    states, optimizer = _check_states_file(path)
    before = getattr(_optimizer_of(target), 'loss_scaler', None)
    _load(target, path, states, optimizer)
    opt = _optimizer_of(target)
    for state in states.values():       # Module: adopt the counters and scale now
        if isinstance(state, tuple) and state and hasattr(state[-1], 'opt') \
                and state[-1].opt is not opt and hasattr(opt, '_adopt'):
            opt._adopt(state[-1])
            opt._gate.scale_override = None
        break
    after = getattr(opt, 'loss_scaler', None)
    if before is not None and after is not None and after is not before:
        # Trainer.load_states replaced the optimizer: keep the caller's scaler object
        # (which scales the loss) live, with the loaded state.
        before.load_state_dict(after.state_dict())
        opt.loss_scaler = before
        _graph_scale.serve(opt.scale_key, before)


def _optimizer_of(target):
    return target._optimizer if isinstance(target, mx.gluon.Trainer) else \
        getattr(target, '_optimizer', None)


def _load(target, path, states, optimizer):
    if isinstance(target, mx.gluon.Trainer):
        if not target._kv_initialized:
            target._init_kvstore()
        if optimizer is not None and type(optimizer) is not type(target._optimizer) \
                and not target._update_on_kvstore:
            # e.g. written by MXNet's built-in LBSGD: keep this trainer's optimizer and
            # take the per-parameter states (their layout is checked at the next step).
            blob = pickle.dumps(states)
            for updater in target._updaters:
                updater.set_states(blob)
            return
        target.load_states(path)
    elif isinstance(target, mx.module.BaseModule):
        target.load_optimizer_states(path)
    else:
        raise TypeError('target must be a gluon.Trainer or a Module; got %r' % (target,))


def save_checkpoint(mod, prefix, epoch, save_optimizer_states=True):
    """`Module.save_checkpoint`, with every file written atomically:
    prefix-symbol.json, prefix-%04d.params and (optionally) prefix-%04d.states."""
    _atomic_write('%s-symbol.json' % prefix, mod.symbol.save)
    _atomic_write('%s-%04d.params' % (prefix, epoch), mod.save_params)
    if save_optimizer_states:
        save_states(mod, '%s-%04d.states' % (prefix, epoch))
