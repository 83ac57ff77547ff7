"""The examples in the public docstrings run, and every public name has one.

For each public module (the API reference's list, ``docs/_ext/apicheck.py``), the doctests
of the module's docstring and of every object in its ``__all__`` (classes with their
methods) run in this process, with ``ELLIPSIS | NORMALIZE_WHITESPACE``; an object exported
by several modules runs once, under the first. Examples that need several processes or
Horovod mark those lines ``# doctest: +SKIP`` and say in prose what they do.

The few examples written in the reference pages themselves (``docs/api/*.rst``: data
entries, which have no docstring of their own) run too, one case per page.

Every public class and function has a docstring with an ``Examples`` section, except the
few in `EXEMPT`, each with its reason.
"""
import doctest
import glob
import importlib
import inspect
import os
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'docs', '_ext'))
from apicheck import PUBLIC_MODULES  # noqa: E402  (the one list of public modules)

OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
#: public classes and functions without an Examples section: {module.name: reason}
EXEMPT = {
    'mx_lbsgd.MXNET_LBSGD': "MXNet's own LBSGD class, re-exported: its docstring is MXNet's "
                            '(the reference entry has the example)',
}


def _public(modname):
    """[(qualified name, object)] of `modname`'s ``__all__``."""
    module = importlib.import_module(modname)
    return [('%s.%s' % (modname, name), getattr(module, name)) for name in module.__all__]


def _owner():
    """{id(object): the first public module that exports it}: where its doctests run."""
    owner = {}
    for modname in PUBLIC_MODULES:
        for _, obj in _public(modname):
            owner.setdefault(id(obj), modname)
    return owner


def _tests(modname):
    """The doctests of `modname` and of the objects of its ``__all__`` it owns."""
    module = importlib.import_module(modname)
    finder = doctest.DocTestFinder(exclude_empty=True)
    owner = _owner()
    found, seen = [], set()
    targets = [(name, obj) for name, obj in _public(modname)
               if owner[id(obj)] == modname and (inspect.isclass(obj) or inspect.isroutine(obj))]
    tests = [t for t in finder.find(module, modname) if t.name == modname]   # its docstring
    for name, obj in targets:
        tests += finder.find(obj, name, module=inspect.getmodule(obj), globs=dict(vars(module)))
    for test in tests:
        key = (test.filename, test.lineno, test.docstring)
        if key not in seen and test.examples:
            seen.add(key)
            found.append(test)
    return found


@pytest.mark.parametrize('modname', PUBLIC_MODULES)
def test_docstring_examples_run(modname):
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    reports = []
    for test in _tests(modname):
        out = []
        result = runner.run(test, out=out.append, clear_globs=True)
        if result.failed:
            reports.append(''.join(out))
    assert not reports, '\n'.join(reports)


API_PAGES = sorted(glob.glob(os.path.join(ROOT, 'docs', 'api', '*.rst')))


@pytest.mark.parametrize('page', API_PAGES, ids=os.path.basename)
def test_reference_page_examples_run(page):
    with open(page, encoding='utf-8') as f:
        text = f.read()
    test = doctest.DocTestParser().get_doctest(text, {}, os.path.basename(page), page, 0)
    out = []
    result = doctest.DocTestRunner(optionflags=OPTIONS).run(test, out=out.append)
    assert not result.failed, ''.join(out)


def _public_routines():
    """[(qualified name, object)] of every public class and function, once each."""
    out, seen = [], set()
    for modname in PUBLIC_MODULES:
        for name, obj in _public(modname):
            if (inspect.isclass(obj) or inspect.isroutine(obj)) and id(obj) not in seen:
                seen.add(id(obj))
                out.append((name, obj))
    return out


def test_every_public_name_has_a_docstring():
    missing = [name for name, obj in _public_routines()
               if name not in EXEMPT and not (obj.__doc__ or '').strip()]
    assert not missing, 'public names without a docstring: %s' % ', '.join(missing)


def test_every_public_name_has_examples():
    missing = []
    for name, obj in _public_routines():
        doc = inspect.cleandoc(obj.__doc__ or '')
        if name not in EXEMPT and ('\nExamples\n--------' not in doc or '>>> ' not in doc):
            missing.append(name)
    assert not missing, ('public classes/functions without an Examples section (with a '
                         '>>> doctest): %s' % ', '.join(missing))


def test_exemptions_are_current():
    names = {name for name, _ in _public_routines()}
    assert set(EXEMPT) <= names, 'EXEMPT lists names that are not public: %s' % (
        sorted(set(EXEMPT) - names))
