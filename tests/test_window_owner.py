"""The window length has one owner and one writer; the optimizer's ``batch_scale`` is a
view of it.

``batch_scale`` (the length of the accumulation window) is a read-only property of the
shell: the fixed length, written by ``PipelineOptimizer._set_window_length`` alone, or with
``batch_scale='auto'`` the length its chooser's segments hold (`BatchChoiceState.window`,
which only the chooser's ``window_begins`` extends). This scans the syntax trees of the
library for assignments to an attribute or a key called ``batch_scale`` or
``_window_length`` (``x.batch_scale = ...``, ``d['batch_scale'] = ...``, augmented or
annotated ones, ``setattr(x, 'batch_scale', ...)``). Two are not the window: `Warmup`'s
own constructor argument of that name (the micro-batches per update its schedule counts
in), and the plain ``batch_scale`` entry that a pickled optimizer carries (as files
written by every version have it)."""
import ast
import os

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ('batch_scale', '_window_length')

#: (file, function) of the writer
WRITER = ('mx_lbsgd/pipeline/shell.py', '_set_window_length')
#: writes of a value called batch_scale that is not the window
NOT_THE_WINDOW = {('mx_lbsgd/pipeline/warmup.py', '__init__'): 'self.batch_scale',
                  ('mx_lbsgd/pipeline/step.py', 'pickled'): "state['batch_scale']"}


def _writes(tree):
    """[(function name or '<module>', line, text)] of every write to a `NAMES` attribute
    or key in `tree`."""
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef,
                                                     ast.AsyncFunctionDef)) else function
            found.extend((function, child.lineno, ast.unparse(t)) for t in _targets(child))
            visit(child, inner)
    visit(tree, '<module>')
    return found


def _targets(node):
    """The written targets of `node` that name `NAMES`."""
    if isinstance(node, ast.Assign):
        candidates = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        candidates = [node.target]
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == 'setattr' and len(node.args) > 1
          and isinstance(node.args[1], ast.Constant) and node.args[1].value in NAMES):
        return [node]
    else:
        return []
    hits = []
    for target in candidates:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Attribute) and sub.attr in NAMES:
                hits.append(sub)
            elif (isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant)
                  and sub.slice.value in NAMES):
                hits.append(sub)
    return hits


def _library_writes():
    found = {}
    for base, dirs, files in os.walk(os.path.join(ROOT, 'mx_lbsgd')):
        dirs[:] = sorted(d for d in dirs if d not in ('__pycache__', 'demo'))
        for name in sorted(files):
            if name.endswith('.py'):
                path = os.path.join(base, name)
                rel = os.path.relpath(path, ROOT)
                with open(path, encoding='utf-8') as f:
                    for function, line, text in _writes(ast.parse(f.read(), rel)):
                        found.setdefault((rel, function), []).append((line, text))
    return found


def test_the_window_length_has_one_writer():
    found = _library_writes()
    for key, text in NOT_THE_WINDOW.items():
        assert [t for _, t in found.pop(key, [])] == [text], (key, text)
    assert list(found) == [WRITER], (
        'the window length is assigned outside %s:%s: %s'
        % (WRITER + ({k: v for k, v in found.items() if k != WRITER},)))
    assert [t for _, t in found[WRITER]] == ['self._window_length'], found[WRITER]


def test_batch_scale_is_a_read_only_view():
    import mx_lbsgd
    opt = mx_lbsgd.LBSGD(batch_scale=2)
    assert opt.batch_scale == 2
    with pytest.raises(AttributeError):
        opt.batch_scale = 3
    auto = mx_lbsgd.LBSGD(batch_scale='auto', batch_scale_bounds=(2, 8),
                          lr_scaling='linear')
    assert auto.batch_scale == auto._pieces.lr_gain.chooser.state.window


def test_the_scan_finds_every_kind_of_write():
    planted = '''
def a(opt):
    opt.batch_scale = 2
def b(d):
    d['batch_scale'] = 3
def c(opt):
    opt.batch_scale += 1
def d(opt):
    setattr(opt, 'batch_scale', 4)
def e(opt):
    x, opt.batch_scale = 1, 2
def f(opt):
    opt.batch_scale_bounds = (1, 2)
    return opt.batch_scale
'''
    found = _writes(ast.parse(planted))
    assert [(function, text) for function, _, text in found] == [
        ('a', 'opt.batch_scale'), ('b', "d['batch_scale']"), ('c', 'opt.batch_scale'),
        ('d', "setattr(opt, 'batch_scale', 4)"), ('e', 'opt.batch_scale')]
