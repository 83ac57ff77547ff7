"""Argument parsing shared by the demo's commands: one-line errors (exit status 2), number
types with bounds, the check for the ``demo`` extra, the writable-folder check."""
import argparse
import os
import tempfile

__all__ = ['Parser', 'UsageError', 'number', 'DEMO_MODULES', 'DEMO_INSTALL', 'demo_missing',
           'demo_error', 'require_demo', 'require_writable_dir', 'require_writable_file',
           'write_or_keep', 'check_output_option', 'require_plot_file', 'SEED_MAX']

#: the largest --seed of train and study (NumPy's RandomState takes < 2**32; they add to it)
SEED_MAX = 2 ** 31 - 1


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: 'PROG: error: MESSAGE'."""

    def error(self, message):
        self.exit(2, '%s: error: %s (see %s --help)\n' % (self.prog, message, self.prog))


class UsageError(Exception):
    """A bad argument found after parsing; the command prints it as one line, exit
    status 2."""


#: The ``demo`` extra: module imported -> distribution that provides it.
DEMO_MODULES = {'sklearn.datasets': 'scikit-learn', 'matplotlib': 'matplotlib', 'tqdm': 'tqdm'}
DEMO_INSTALL = "pip install 'mx_lbsgd[demo]'"


def demo_missing(modules=tuple(DEMO_MODULES)):
    """The distributions (of DEMO_MODULES) whose module in `modules` fails to import."""
    missing = []
    for name in modules:
        try:
            __import__(name)        # looked up at call time: honours a patched __import__
        except ImportError:
            missing.append(DEMO_MODULES[name])
    return missing


def demo_error(prog, missing, what='this command'):
    """The one-line message for `what` of `prog`, which needs the (missing) demo extra."""
    return ('%s: error: %s needs the demo extra (missing: %s): %s (in a source checkout: '
            "pip install '.[demo]')" % (prog, what, ', '.join(missing), DEMO_INSTALL))


def require_demo(prog, modules=tuple(DEMO_MODULES), what='this command'):
    """UsageError (one line, exit status 2) if a module of the demo extra is missing."""
    missing = demo_missing(modules)
    if missing:
        raise UsageError(demo_error(prog, missing, what))


def require_writable_dir(prog, path, option='--out'):
    """UsageError naming `option` unless `path` is (or can be created as) a folder we can
    write into.

    Probes by creating and removing a temporary folder in `path` or, if it does not exist
    yet, in its nearest existing ancestor, so nothing is left behind. (os.access is no
    test: root passes it for read-only permissions, and /proc refuses anyway.)"""
    target = os.path.abspath(path)
    probe = target
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    try:
        if os.path.isdir(probe):
            os.rmdir(tempfile.mkdtemp(prefix='.mx-lbsgd-probe-', dir=probe))
            return
        reason = ('it exists and is not a folder' if probe == target
                  else '%s is not a folder' % probe)
    except OSError as err:
        reason = 'cannot create a folder in %s (%s)' % (probe, err.strerror or err)
    raise UsageError('%s: error: argument %s: %s is not writable: %s'
                     % (prog, option, path, reason))


def require_writable_file(prog, option, path):
    """UsageError naming `option` unless file `path` can be written (its folder, created
    when the file is written, may not exist yet).

    Probes like require_writable_dir: a temporary file in the nearest existing folder,
    removed at once; an existing `path` must be a file."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        reason = 'it is a folder'
    else:
        probe = os.path.dirname(target)
        while not os.path.lexists(probe):
            probe = os.path.dirname(probe)
        try:
            if not os.path.isdir(probe):
                reason = '%s is not a folder' % probe
            else:
                fd, name = tempfile.mkstemp(prefix='.mx-lbsgd-probe-', dir=probe)
                os.close(fd)
                os.remove(name)
                if not os.path.exists(target) or os.access(target, os.W_OK):
                    return
                reason = 'the file is read-only'
        except OSError as err:
            reason = 'cannot create a file in %s (%s)' % (probe, err.strerror or err)
    raise UsageError('%s: error: argument %s: %s is not writable: %s'
                     % (prog, option, path, reason))


def require_plot_file(prog, option, path):
    """UsageError naming `option` unless matplotlib can write `path` (a format it knows,
    by the file's extension; png without one) and the file can be written."""
    from matplotlib.backend_bases import FigureCanvasBase
    ext = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext and ext not in formats:
        raise UsageError('%s: error: argument %s: cannot plot into %s: matplotlib writes %s '
                         '(by the extension)' % (prog, option, path, ', '.join(sorted(formats))))
    require_writable_file(prog, option, path)


def write_or_keep(prog, option, path, write, keep_suffix):
    """Call ``write(path)``; if that fails (the folder vanished or filled up after the
    checks), call ``write(spare)`` with a new file in the temporary folder (name ending in
    `keep_suffix`) and raise UsageError saying where the results went, so that work already
    done is not lost. Returns `path`."""
    try:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        write(path)
        return path
    except OSError as err:
        why = err.strerror or str(err)
    fd, spare = tempfile.mkstemp(prefix='mx-lbsgd-', suffix=keep_suffix)
    os.close(fd)
    write(spare)
    raise UsageError('%s: error: argument %s: could not write %s (%s); the results were '
                     'kept in %s' % (prog, option, path, why, spare))


def number(kind, low=None, high=None, open_low=False, open_high=False):
    """An argparse type: `kind` (int or float) within the given bounds."""
    def shown(bound):
        return '%d' % bound if kind is int else '%g' % bound

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                'invalid %s %r' % ('integer' if kind is int else 'number', text)) from None
        if value != value:
            raise argparse.ArgumentTypeError('invalid number %r' % text)
        if low is not None and (value <= low if open_low else value < low):
            raise argparse.ArgumentTypeError('must be %s %s, got %s'
                                             % ('>' if open_low else '>=', shown(low), text))
        if high is not None and (value >= high if open_high else value > high):
            raise argparse.ArgumentTypeError('must be %s %s, got %s'
                                             % ('<' if open_high else '<=', shown(high), text))
        return value
    return parse


def check_output_option(parser, option, path):
    """Exit 2 with one line (``parser.exit``) unless file `path` given to `option` can be
    written: for commands that are also run as ``python -m`` (the benchmarks)."""
    if path:
        try:
            require_writable_file(parser.prog, option, path)
        except UsageError as err:
            parser.exit(2, '%s\n' % err)
