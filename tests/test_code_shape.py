"""The library's shape, measured on its source: type hints on (nearly) every argument and
return, no class over 200 code lines, no function with a cyclomatic complexity over 20, and
no private name imported from outside the package that defines it.

The library is ``mx_lbsgd/`` (a ``demo`` folder in it, while one exists, is not library).
Each assertion message names the files, classes, functions or imports at fault."""
import ast
import io
import os
import tokenize

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = 'mx_lbsgd'
#: Packages outside the library that use it (public names only), and loose scripts.
USERS = ('mx_lbsgd_demo', 'mx_lbsgd_bench')
SCRIPTS = 'benchmarks'
#: The project's own top-level packages: the private-name rule applies to their names.
PROJECT = (LIBRARY,) + USERS

MIN_TYPE_COVERAGE = 0.90
MAX_CLASS_LINES = 200
MAX_COMPLEXITY = 20

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_SCOPES = _FUNCTIONS + (ast.ClassDef, ast.Module)


def _python_files(folder, skip=('__pycache__',)):
    """Paths (relative to the repository root) of the .py files under `folder`, sorted."""
    found = []
    for base, dirs, files in os.walk(os.path.join(ROOT, folder)):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        found += [os.path.relpath(os.path.join(base, f), ROOT) for f in sorted(files)
                  if f.endswith('.py')]
    return found


def _library_files():
    return _python_files(LIBRARY, skip=('__pycache__', 'demo'))


def _source(rel):
    with open(os.path.join(ROOT, rel), encoding='utf-8') as f:
        return f.read()


def _tree(rel):
    return ast.parse(_source(rel), rel)


# -- type hints -------------------------------------------------------------------------------

def _annotation_counts(tree):
    """(annotated, total) over the arguments (``self``/``cls`` of a method excepted,
    ``*args``, ``**kwargs`` and keyword-only ones included) and the returns of every function,
    method and nested function; ``__init__`` needs its ``-> None`` too."""
    methods = {id(node) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
               for node in cls.body if isinstance(node, _FUNCTIONS)}
    annotated = total = 0
    for node in ast.walk(tree):
        if not isinstance(node, _FUNCTIONS):
            continue
        args = node.args
        positional = list(getattr(args, 'posonlyargs', [])) + list(args.args)
        if (id(node) in methods and positional and positional[0].arg in ('self', 'cls')
                and not _is_staticmethod(node)):
            positional = positional[1:]
        every = positional + list(args.kwonlyargs) + [a for a in (args.vararg, args.kwarg) if a]
        total += len(every) + 1
        annotated += sum(a.annotation is not None for a in every) + (node.returns is not None)
    return annotated, total


def _is_staticmethod(node):
    return any(isinstance(d, ast.Name) and d.id == 'staticmethod' for d in node.decorator_list)


def test_type_coverage():
    per_file = {rel: _annotation_counts(_tree(rel)) for rel in _library_files()}
    annotated = sum(a for a, _ in per_file.values())
    total = sum(t for _, t in per_file.values())
    assert total > 0
    ratio = annotated / total
    rows = sorted(((a / t if t else 1.0), rel, a, t) for rel, (a, t) in per_file.items())
    table = '\n'.join('  %-40s %4d / %-4d %6.1f%%' % (rel, a, t, 100 * r)
                      for r, rel, a, t in rows if r < 1.0)
    assert ratio >= MIN_TYPE_COVERAGE, (
        'type hints on %d of %d arguments and returns in %s/ (%.1f%%; at least %.0f%% '
        'wanted). Files not fully annotated:\n%s'
        % (annotated, total, LIBRARY, 100 * ratio, 100 * MIN_TYPE_COVERAGE, table))


# -- class size -------------------------------------------------------------------------------

def _docstring_lines(tree):
    """Line numbers of every docstring (module, class, function) and of every other bare
    string statement (attribute docstrings)."""
    lines = set()
    for node in ast.walk(tree):
        for stmt in getattr(node, 'body', []) if isinstance(node, _SCOPES) else []:
            if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)):
                lines.update(range(stmt.lineno, stmt.end_lineno + 1))
    return lines


def _comment_or_blank_lines(source):
    """Line numbers that hold nothing but a comment, or nothing at all."""
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return set(range(1, source.count('\n') + 2)) - code


def _class_sizes(rel):
    """{qualified class name: code lines}: lines of the class (from its ``class`` line to
    its last), less blank lines, comment lines and docstrings."""
    source = _source(rel)
    tree = ast.parse(source, rel)
    skip = _docstring_lines(tree) | _comment_or_blank_lines(source)
    sizes = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                lines = set(range(child.lineno, child.end_lineno + 1)) - skip
                sizes[name] = len(lines)
            elif isinstance(child, _FUNCTIONS):
                name = prefix + child.name
            if name != prefix:
                visit(child, name + '.')
            else:
                visit(child, prefix)
    visit(tree, '')
    return sizes


def test_longest_class():
    sizes = {'%s:%s' % (rel, name): n for rel in _library_files()
             for name, n in _class_sizes(rel).items()}
    assert sizes, 'no class found'
    over = {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES}
    assert not over, ('classes over %d code lines (blank, comment and docstring lines not '
                      'counted): %s' % (MAX_CLASS_LINES, ', '.join(
                          '%s (%d)' % item for item in sorted(over.items(),
                                                              key=lambda kv: -kv[1]))))


# -- class size with the library's bases ---------------------------------------------------
#: The optimizer presets: a preset is the shell plus its own arguments and pieces, so it is
#: measured alone (the shell, with its bases, is held to the limit on its own).
PRESETS = ('mx_lbsgd.lbsgd:LBSGD', 'mx_lbsgd.lamb:LAMB', 'mx_lbsgd.lssgd:LossScaledSGD')


def _library_classes():
    """{'module:qualified name': class} of every class the library defines at module or
    class level (imported, so that its bases are resolved as Python resolves them)."""
    import importlib
    found = {}
    for rel in _library_files():
        module = importlib.import_module(_module_name(rel))
        for qualname in _class_sizes(rel):
            obj = module
            for part in qualname.split('.'):
                obj = getattr(obj, part, None)
            if isinstance(obj, type) and obj.__module__ == module.__name__:
                found['%s:%s' % (module.__name__, qualname)] = obj
    return found


def _key(cls):
    return '%s:%s' % (cls.__module__, cls.__qualname__)


def _library_bases(cls, classes, direct=True):
    """The library-defined bases of `cls` (Protocols excluded): its direct bases, or every
    one in its MRO."""
    bases = cls.__bases__ if direct else cls.__mro__[1:]
    return [b for b in bases if _key(b) in classes and not getattr(b, '_is_protocol', False)]


def _sizes_by_key():
    return {'%s:%s' % (_module_name(rel), name): n for rel in _library_files()
            for name, n in _class_sizes(rel).items()}


def test_no_class_has_two_library_bases():
    classes = _library_classes()
    assert len(classes) > 50, 'the library classes were not found: %s' % sorted(classes)
    mixed = {key: [_key(b) for b in _library_bases(cls, classes)]
             for key, cls in classes.items() if len(_library_bases(cls, classes)) > 1}
    assert not mixed, ('classes with more than one library-defined base (Protocols '
                       'excluded): %s' % mixed)


def test_a_class_with_its_library_bases_fits():
    classes, sizes = _library_classes(), _sizes_by_key()
    assert 'mx_lbsgd.pipeline.shell:PipelineOptimizer' in classes
    counted = {key: sizes[key] + sum(sizes[_key(b)] for b in
                                     _library_bases(cls, classes, direct=False))
               for key, cls in classes.items() if key not in PRESETS}
    over = {key: n for key, n in counted.items() if n > MAX_CLASS_LINES}
    assert not over, ('classes over %d code lines counted with the library-defined bases '
                      'they inherit (blank, comment and docstring lines not counted): %s'
                      % (MAX_CLASS_LINES, over))


def test_the_base_counting_sees_a_mixin():
    """The counter adds a library base's lines: a class of 150 lines over a 100-line base
    of the library counts 250."""
    classes = _library_classes()
    shell = classes['mx_lbsgd.pipeline.shell:PipelineOptimizer']
    preset = classes['mx_lbsgd.lbsgd:LBSGD']
    assert _library_bases(preset, classes) == [shell]
    sizes = _sizes_by_key()
    total = sizes[_key(preset)] + sum(sizes[_key(b)] for b in
                                      _library_bases(preset, classes, direct=False))
    assert total == sizes[_key(preset)] + sizes[_key(shell)] > MAX_CLASS_LINES


# -- complexity -------------------------------------------------------------------------------

def _radon_functions(blocks, prefix=''):
    """(qualified name, complexity) of every function, method and closure in radon's blocks
    (``cc_visit`` lists the functions, the classes and the classes' methods; methods of
    nested classes are only in their class's ``inner_classes``)."""
    for block in blocks:
        if hasattr(block, 'methods'):                      # a class
            for inner in block.inner_classes:
                yield from _radon_class(inner, prefix + block.name + '.')
        else:
            name = prefix + (block.name if prefix else block.fullname)
            yield name, block.complexity
            yield from _radon_functions(block.closures, name + '.')


def _radon_class(cls, prefix):
    """The methods (and closures) of a nested class and of the classes nested in it."""
    yield from _radon_functions(cls.methods, prefix + cls.name + '.')
    for inner in cls.inner_classes:
        yield from _radon_class(inner, prefix + cls.name + '.')


def test_complexity():
    complexity = pytest.importorskip('radon.complexity')
    found = {}
    for rel in _library_files():
        for name, cc in _radon_functions(complexity.cc_visit(_source(rel))):
            found['%s:%s' % (rel, name)] = cc
    assert found, 'no function found'
    over = {name: cc for name, cc in found.items() if cc > MAX_COMPLEXITY}
    assert not over, ('functions with a cyclomatic complexity over %d (radon cc): %s'
                      % (MAX_COMPLEXITY, ', '.join('%s (%d)' % item for item in sorted(
                          over.items(), key=lambda kv: -kv[1]))))


# -- private names --------------------------------------------------------------------------

def _module_name(rel):
    """The dotted module name of a source file (a loose script: its file name)."""
    parts = rel[:-3].split(os.sep)
    if parts[0] == SCRIPTS:
        return parts[-1]
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _is_package(rel):
    return rel.endswith('__init__.py')


def _resolve(rel, node):
    """The absolute module an ImportFrom node imports from, resolved against file `rel`."""
    if not node.level:
        return node.module
    package = _module_name(rel).split('.')
    if not _is_package(rel):
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return '.'.join(base + ([node.module] if node.module else []))


def _imported_names(rel, tree):
    """Absolute dotted names of everything the file imports (``import a.b``: ``a.b``;
    ``from a.b import c``: ``a.b.c``, which is a module or a name defined in ``a.b``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(rel, node)
            for alias in node.names:
                if alias.name != '*':
                    yield '%s.%s' % (module, alias.name)


def _private(name):
    return name.startswith('_') and not (name.startswith('__') and name.endswith('__'))


def _is_module(dotted):
    """Whether `dotted` names a module or package of the repository (not a name in one)."""
    path = os.path.join(ROOT, *dotted.split('.'))
    return os.path.isfile(path + '.py') or os.path.isfile(os.path.join(path, '__init__.py'))


def _is_package_name(dotted):
    return os.path.isfile(os.path.join(ROOT, *dotted.split('.'), '__init__.py'))


def _owners(dotted):
    """For each private component of `dotted`: the package that defines it (the package
    that contains a private module, or the package of the module that defines a private
    name; a private name defined in a package's ``__init__`` belongs to that package)."""
    parts = dotted.split('.')
    for i in range(1, len(parts)):
        if not _private(parts[i]):
            continue
        parent = '.'.join(parts[:i])
        if _is_module('.'.join(parts[:i + 1])) or _is_package_name(parent):
            yield parent                        # a private module, or a name, of `parent`
        else:
            yield '.'.join(parts[:i - 1])       # a name in module `parent`: its package


def _inside(module, package):
    return module == package or module.startswith(package + '.')


def _private_import_violations():
    files = _python_files(LIBRARY) + [rel for top in USERS if os.path.isdir(os.path.join(
        ROOT, top)) for rel in _python_files(top)]
    if os.path.isdir(os.path.join(ROOT, SCRIPTS)):
        files += [os.path.join(SCRIPTS, f) for f in sorted(os.listdir(
            os.path.join(ROOT, SCRIPTS))) if f.endswith('.py')]
    bad = set()
    for rel in files:
        importer = _module_name(rel)
        for name in _imported_names(rel, _tree(rel)):
            if name.split('.')[0] not in PROJECT:
                continue
            for owner in _owners(name):
                if not owner or not _inside(importer, owner):
                    bad.add((importer, name))
    return sorted(bad)


def test_no_private_names_across_packages():
    bad = _private_import_violations()
    assert not bad, ('private names imported from outside the package that defines them '
                     '(importer -> imported):\n%s'
                     % '\n'.join('  %s -> %s' % pair for pair in bad))


def test_private_name_rule_examples():
    """The rule on its cases: a subpackage may import its parent package's private module; a
    module may not import a private name of a sibling package's module; the packages outside
    the library may import none of its private names; dunders are not private."""
    assert list(_owners('mx_lbsgd._compat')) == ['mx_lbsgd']
    assert _inside('mx_lbsgd.pipeline.shell', 'mx_lbsgd')
    owners = list(_owners('mx_lbsgd.loss_scaling.scaler._as_scaler'))
    assert owners == ['mx_lbsgd.loss_scaling']
    assert not _inside('mx_lbsgd.lbsgd', owners[0])
    assert _inside('mx_lbsgd.loss_scaling.hook', owners[0])
    assert list(_owners('mx_lbsgd.pipeline._private_name')) == ['mx_lbsgd.pipeline']
    assert not _inside('mx_lbsgd_demo.cli', 'mx_lbsgd')
    assert list(_owners('mx_lbsgd.__version__')) == []
    assert _resolve(os.path.join('mx_lbsgd', 'pipeline', 'shell.py'),
                    ast.parse('from .. import _compat').body[0]) == 'mx_lbsgd'
    assert _resolve(os.path.join('mx_lbsgd', 'pipeline', '__init__.py'),
                    ast.parse('from .shell import x').body[0]) == 'mx_lbsgd.pipeline.shell'
