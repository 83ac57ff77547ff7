"""Every use of a private MXNet (or Horovod-MXNet) attribute lives in ``mx_lbsgd/_compat.py``.

The checker parses every ``.py`` file under ``mx_lbsgd/`` except ``_compat.py`` and reports,
as ``file:line: name``:

- an attribute ``x._name`` (read, written or deleted), or ``getattr``/``setattr``/
  ``hasattr``/``delattr`` with ``'_name'`` as a string literal, where ``_name`` is a private
  name of MXNet's objects;
- a private name of an MXNet or Horovod module, imported or reached through one
  (``mx.nd._internal``, ``from mxnet.base import _LIB``);
- a class of the package that defines (overrides) a private name of one of its MXNet or
  Horovod ancestors (of its own, or of a package class it is mixed into).

MXNet's private names are collected at test time from MXNet itself: ``dir()`` of its classes
(Trainer, Parameter, ParameterDict, Block, HybridBlock, NDArray, Optimizer, Updater, KVStore,
Module, Symbol, LRScheduler, CustomOp, ...), ``vars()`` of small live objects (a Trainer over
an initialized Dense layer after one step, its Parameter and arrays, its Updater and
Optimizer, a local KVStore, a Module after ``bind``/``init_optimizer`` and its executor
group), the ``self._name`` attributes the classes' source assigns, and Horovod's
``DistributedTrainer``/``DistributedOptimizer`` (their methods and ``self._name``
attributes, read from ``horovod/mxnet/__init__.py`` without importing it) when installed.

``self._name`` (or ``cls._name``, ``getattr(self, '_name')``) in a class of the package is
decided by that object's own ancestry, as one reads MXNet's source to decide it:

- ``_name`` is MXNet's when an MXNet/Horovod ancestor of the class, or of a package class it
  is mixed into, has it (``self._params`` in a subclass of ``gluon.Trainer``);
- otherwise it is the package's own state when the class, a package class among its
  ancestors, or a package class it is mixed into assigns or defines it (a bare annotation
  declares, it does not define): ``self._data`` of a helper class, or ``_name`` of an
  optimizer (``Block._name`` is not the Optimizer's);
- otherwise (defined by no one we can see) it is flagged.

Any other object (``trainer._optimizer``, ``super()._update_count``) is judged by the name.
"""
import ast
import functools
import importlib
import importlib.util
import inspect
import os
import textwrap

import mxnet as mx
import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = 'mx_lbsgd'
COMPAT = os.path.join(PACKAGE, '_compat.py')
#: Top-level modules whose classes and objects are "MXNet's" here.
FOREIGN = ('mxnet', 'horovod')
_ACCESSORS = ('getattr', 'setattr', 'hasattr', 'delattr')
_SELF = ('self', 'cls')


def _is_private(name):
    return name.startswith('_') and not (name.startswith('__') and name.endswith('__'))


def _is_foreign(module):
    return (module or '').split('.')[0] in FOREIGN


# -- MXNet's private names ----------------------------------------------------------------

def _classes():
    return [mx.gluon.Trainer, mx.gluon.Parameter, mx.gluon.ParameterDict, mx.gluon.Block,
            mx.gluon.HybridBlock, mx.gluon.SymbolBlock, mx.nd.NDArray,
            mx.nd.sparse.RowSparseNDArray, mx.np.ndarray, mx.optimizer.Optimizer,
            mx.optimizer.Updater, mx.kvstore.KVStore, mx.kvstore.KVStoreBase,
            mx.kvstore.KVStoreServer, mx.module.BaseModule, mx.module.Module, mx.sym.Symbol,
            mx.lr_scheduler.LRScheduler, mx.operator.CustomOp, mx.operator.CustomOpProp,
            mx.context.Context]


@functools.lru_cache(maxsize=None)
def _live_objects():
    """Small live MXNet objects, in the state the package sees them in."""
    net = mx.gluon.nn.Dense(2, in_units=3)
    net.initialize()
    trainer = mx.gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    x = mx.nd.ones((4, 3))
    with mx.autograd.record():
        loss = net(x).sum()
    loss.backward()
    trainer.step(4)
    param = net.weight
    data = mx.sym.Variable('data')
    mod = mx.mod.Module(mx.sym.FullyConnected(data, num_hidden=2, name='fc'),
                        data_names=['data'], label_names=None)
    mod.bind(data_shapes=[('data', (4, 3))])
    mod.init_params()
    mod.init_optimizer(optimizer='sgd')
    return (trainer, param, net, net.collect_params(), x, param.data(), param.grad(),
            trainer._updaters[0], trainer._optimizer, mod, mod._exec_group, mod._updater,
            mod._optimizer, mx.kv.create('local'), data, mx.lr_scheduler.FactorScheduler(10))


def _instance_names(obj):
    names = set(getattr(obj, '__dict__', {}))
    for klass in type(obj).__mro__:
        names.update(getattr(klass, '__slots__', ()))
    return names


def _assigned_in(tree):
    """``_name`` of every ``self._name = ...`` (or ``del``, augmented) in `tree`."""
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del))
            and isinstance(node.value, ast.Name) and node.value.id == 'self'}


@functools.lru_cache(maxsize=None)
def _assigned_on_self(klass):
    try:
        return frozenset(_assigned_in(ast.parse(textwrap.dedent(inspect.getsource(klass)))))
    except (OSError, TypeError, SyntaxError):
        return frozenset()


@functools.lru_cache(maxsize=None)
def _names_of(klass):
    """Private names of an MXNet class: its ``dir()``, what its (and its MXNet bases')
    source assigns to ``self``, and ``vars()`` of the live objects that are instances of it."""
    names = set(dir(klass))
    for base in klass.__mro__:
        if _is_foreign(base.__module__):
            names |= _assigned_on_self(base)
    for obj in _live_objects():
        if isinstance(obj, klass):
            names |= _instance_names(obj)
    return frozenset(n for n in names if _is_private(n))


@functools.lru_cache(maxsize=None)
def _horovod_names():
    """Methods and ``self._name`` attributes of horovod.mxnet's DistributedTrainer and
    DistributedOptimizer, read from the source (importing it loads Horovod's library)."""
    spec = importlib.util.find_spec('horovod')
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    path = os.path.join(list(spec.submodule_search_locations)[0], 'mxnet', '__init__.py')
    if not os.path.exists(path):
        return frozenset()
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ('DistributedTrainer',
                                                             'DistributedOptimizer'):
            names |= _defined_names(node)
    return frozenset(n for n in names if _is_private(n))


@functools.lru_cache(maxsize=None)
def mxnet_private_names():
    """Every single-underscore name of MXNet's (and Horovod-MXNet's) classes and objects."""
    names = set(_horovod_names())
    for klass in _classes():
        names |= _names_of(klass)
    for obj in _live_objects():
        names |= _names_of(type(obj)) | {n for n in _instance_names(obj) if _is_private(n)}
    return frozenset(names)


def _resolve(dotted):
    """The object a dotted path names (``mxnet.gluon.Trainer``), or None."""
    parts = dotted.split('.')
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module('.'.join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def _names_at(dotted):
    """Private names of the MXNet/Horovod class at `dotted` (all of them when it cannot be
    resolved here: Horovod's classes are not imported)."""
    klass = _resolve(dotted) if not dotted.startswith('horovod') else None
    return _names_of(klass) if isinstance(klass, type) else mxnet_private_names()


# -- the package's classes ----------------------------------------------------------------

def _dotted(expr):
    """'mx.gluon.Trainer' for that expression (a subscript's class: ``Generic[T]``)."""
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    return '.'.join([expr.id] + parts[::-1])


def _imported(tree, module):
    """{local name: dotted path of what it names} for every import of the file."""
    out = {}
    package = module.split('.')[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = alias.name
                else:
                    out[alias.name.split('.')[0]] = alias.name.split('.')[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                source = '.'.join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ''
            for alias in node.names:
                out[alias.asname or alias.name] = source + '.' + alias.name
    return out


def _defined_names(node):
    """Names ClassDef `node` defines: its body's (`_body_names`) and what its methods assign
    to ``self.<name>``/``cls.<name>`` (or with ``setattr``)."""
    names = _body_names(node)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                and isinstance(sub.value, ast.Name) and sub.value.id in _SELF:
            names.add(sub.attr)
        elif _accessor(sub) == 'setattr' and isinstance(sub.args[0], ast.Name) \
                and sub.args[0].id in _SELF:
            names.add(sub.args[1].value)
    return names


def _body_names(node):
    """Names ClassDef `node`'s body defines: methods, nested classes, class attributes with
    a value, ``__slots__``. A bare annotation (``_name: Callable``) declares what a host
    provides: not counted."""
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        targets = item.targets if isinstance(item, ast.Assign) else \
            [item.target] if isinstance(item, ast.AugAssign) or \
            (isinstance(item, ast.AnnAssign) and item.value is not None) else []
        for target in targets:
            if isinstance(target, ast.Name):
                names.add(target.id)
                if target.id == '__slots__' and isinstance(item.value, (ast.Tuple, ast.List)):
                    names.update(e.value for e in item.value.elts
                                 if isinstance(e, ast.Constant))
    return names


def _accessor(node):
    """'getattr' for ``getattr(x, '<literal>', ...)`` (and setattr, ...), else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in _ACCESSORS and len(node.args) >= 2 \
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        return node.func.id
    return None


class _Classes:
    """The package's classes: which are MXNet's subclasses, which are mixed into which, and
    what each defines. A base is matched to the package's classes by name."""

    def __init__(self, trees):
        self.imports = {}                      # ClassDef -> {local name: dotted path}
        self.by_name = {}                      # class name -> [ClassDef]
        self._memo = {}
        for tree, module in trees:
            imports = _imported(tree, module)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.imports[node] = imports
                    self.by_name.setdefault(node.name, []).append(node)

    def _ancestry(self, node):
        """(the package classes among `node` and its ancestors, the dotted paths of its
        MXNet/Horovod bases)."""
        if ('ancestry', node) not in self._memo:
            self._memo['ancestry', node] = self._walk(node)
        return self._memo['ancestry', node]

    def _walk(self, node):
        own, foreign, todo = [], [], [node]
        while todo:
            klass = todo.pop()
            if klass in own:
                continue
            own.append(klass)
            for base in klass.bases:
                dotted = _dotted(base)
                if dotted is None:
                    continue
                root, _, rest = dotted.partition('.')
                path = self.imports[klass].get(root, root) + ('.' + rest if rest else '')
                if _is_foreign(path):
                    foreign.append(path)
                else:
                    todo += self.by_name.get(dotted.split('.')[-1], [])
        return own, foreign

    def hosts(self, node):
        """`node` and every package class that has it among its ancestors."""
        if ('hosts', node) not in self._memo:
            self._memo['hosts', node] = [other for other in self.imports
                                         if node in self._ancestry(other)[0]]
        return self._memo['hosts', node]

    def mxnet_names(self, node):
        """Private names of the MXNet/Horovod ancestors of `node` and of its hosts."""
        if ('names', node) not in self._memo:
            names = set()
            for host in self.hosts(node):
                for path in self._ancestry(host)[1]:
                    names |= _names_at(path)
            self._memo['names', node] = names
        return self._memo['names', node]

    def defines(self, node, name):
        """Whether `node`, a package class among its ancestors, or one of its hosts (or
        their package ancestors) defines `name`."""
        return any(name in _defined_names(klass) for host in self.hosts(node)
                   for klass in self._ancestry(host)[0])


# -- the checker --------------------------------------------------------------------------

class _Checker(ast.NodeVisitor):
    def __init__(self, rel, private, classes, imports):
        self.rel, self.private, self.classes, self.imports = rel, private, classes, imports
        self.stack = []          # enclosing ClassDef nodes
        self.found = []

    def visit_Import(self, node):
        for alias in node.names:
            if _is_foreign(alias.name) and any(map(_is_private, alias.name.split('.'))):
                self.found.append((self.rel, node.lineno, 'import ' + alias.name))

    def visit_ImportFrom(self, node):
        if node.level or not _is_foreign(node.module):
            return
        for alias in node.names:
            dotted = node.module + '.' + alias.name
            if any(map(_is_private, dotted.split('.'))):
                self.found.append((self.rel, node.lineno, 'from %s import %s' % (
                    node.module, alias.name)))

    def visit_ClassDef(self, node):
        overridden = _body_names(node) & self.classes.mxnet_names(node)
        for name in sorted(overridden):
            line = next((item.lineno for item in node.body
                         if getattr(item, 'name', None) == name), node.lineno)
            self.found.append((self.rel, line, '%s (%s overrides an MXNet/Horovod '
                               'ancestor\'s private attribute)' % (name, node.name)))
        self.stack.append(node)
        self.generic_visit(node)
        self.stack.pop()

    def visit_FunctionDef(self, node):
        # a function nested in a method keeps `self`; a nested class starts its own scope
        self.generic_visit(node)

    def visit_Attribute(self, node):
        dotted = _dotted(node.value)
        root, _, rest = (dotted or '').partition('.')
        if root in self.imports and _is_foreign(self.imports[root]):
            # a private name of an MXNet/Horovod module (mx.nd._internal), or of what it
            # holds; reported once, at the first private part of the chain
            if _is_private(node.attr) and not any(map(_is_private, rest.split('.'))):
                self.found.append((self.rel, node.lineno, '%s.%s' % (dotted, node.attr)))
        else:
            self._check(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node):
        if _accessor(node):
            self._check(node, node.args[0], node.args[1].value)
        self.generic_visit(node)

    def _check(self, node, owner, name):
        if not _is_private(name) or self._allowed(owner, name):
            return
        self.found.append((self.rel, node.lineno, name))

    def _allowed(self, owner, name):
        if not (self.stack and isinstance(owner, ast.Name) and owner.id in _SELF):
            return name not in self.private
        klass = self.stack[-1]
        if name in self.classes.mxnet_names(klass):
            return False
        return name not in self.private or self.classes.defines(klass, name)


def check_sources(sources, private=None):
    """[(file, line, name)] of every private MXNet access in `sources` ({file: source})."""
    private = mxnet_private_names() if private is None else private
    trees = {rel: (ast.parse(text, rel), rel[:-3].replace(os.sep, '.').replace('/', '.'))
             for rel, text in sources.items()}
    classes = _Classes(trees.values())
    found = []
    for rel, (tree, module) in trees.items():
        checker = _Checker(rel, private, classes, _imported(tree, module))
        checker.visit(tree)
        found += checker.found
    return sorted(found)


def _package_sources():
    sources = {}
    for base, dirs, files in os.walk(os.path.join(ROOT, PACKAGE)):
        dirs[:] = sorted(d for d in dirs if d != '__pycache__')
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(base, name), ROOT)
            if name.endswith('.py') and rel != COMPAT:
                with open(os.path.join(base, name)) as f:
                    sources[rel] = f.read()
    return sources


# -- the tests ----------------------------------------------------------------------------

def test_the_private_name_set_is_mxnets():
    """The set holds the internals the package reached for before `_compat` (and no dunder
    name); a Trainer's names are not an Optimizer's."""
    private = mxnet_private_names()
    assert {'_optimizer', '_params', '_updaters', '_scale', '_kvstore', '_data', '_grad',
            '_fresh_grad', '_grad_stype', '_index_update_count', '_exec_group', '_updater',
            '_allreduce_grads', '_update', '_update_count', '_kv_initialized'} <= private
    assert not any(n.startswith('__') and n.endswith('__') for n in private)
    assert '_params' in _names_of(mx.gluon.Trainer)
    assert '_params' not in _names_of(mx.optimizer.Optimizer)
    if importlib.util.find_spec('horovod') is not None:
        assert {'_allreduce_grads', '_average_in_framework', '_prefix'} <= _horovod_names()


def test_no_module_but_compat_touches_a_private_mxnet_attribute():
    found = check_sources(_package_sources())
    assert not found, 'private MXNet attributes outside %s (move each into a _compat ' \
        'function that says why MXNet\'s public API does not suffice):\n%s' % (
            COMPAT, '\n'.join('  %s:%d: %s' % f for f in found))


def test_the_checker_flags_private_mxnet_attributes():
    source = textwrap.dedent('''
        import mxnet as mx
        from mxnet import optimizer

        def learning_rate(trainer):
            return trainer._optimizer.learning_rate

        def params(trainer):
            return getattr(trainer, '_params', [])

        class Mine(mx.gluon.Trainer):
            def _update(self, ignore_stale_grad=False):
                self._scale = 1.0
                self._own = 2                 # Trainer has no _own: Mine's

        class Views:
            _update_count: object             # declared: the host's

            def count(self, index):
                self._update_count(index)

        class Opt(Views, optimizer.Optimizer):
            def _name(self, index):           # Block._name, not the Optimizer's
                return self._name(index)

        from mxnet.base import _LIB
        double = mx.nd._internal._mul_scalar(mx.nd.ones(1), scalar=2.0)
    ''')
    found = check_sources({'mx_lbsgd/probe.py': source})
    assert [(line, name) for _, line, name in found] == [
        (6, '_optimizer'), (9, '_params'),
        (12, "_update (Mine overrides an MXNet/Horovod ancestor's private attribute)"),
        (13, '_scale'), (20, '_update_count'), (26, 'from mxnet.base import _LIB'),
        (27, 'mx.nd._internal')], found


def test_the_checker_allows_a_package_class_own_state():
    source = textwrap.dedent('''
        from .base import Helper

        class Box:
            def __init__(self, data):
                self._data = data

            def get(self):
                return self._data, getattr(self, '_data')

        class Sub(Box):
            def size(self):
                return len(self._data)

        class Other(Helper):
            def peek(self):
                return self._params       # defined by no class of the package
    ''')
    found = check_sources({'mx_lbsgd/probe.py': source})
    assert [(line, name) for _, line, name in found] == [(17, '_params')], found
    other = textwrap.dedent('''
        def peek(box):
            return box._data            # not `self`: whose it is, is not known
    ''')
    assert [name for _, _, name in check_sources({'mx_lbsgd/p.py': other})] == ['_data']
