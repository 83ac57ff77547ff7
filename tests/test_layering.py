"""The packages' layering: the library (mx_lbsgd) never imports the command (mx_lbsgd_demo)
or the benchmarks (mx_lbsgd_bench); those use the library's public API only (names in
``mx_lbsgd.__all__``, public submodules, never ``mx_lbsgd._*``), and the benchmarks use only
public names (``__all__``) of the demo's modules."""
import ast
import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

import mx_lbsgd

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sources(package):
    folder = os.path.join(ROOT, package)
    for base, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != '__pycache__']
        for name in sorted(files):
            if name.endswith('.py'):
                path = os.path.join(base, name)
                with open(path) as f:
                    yield os.path.relpath(path, ROOT), ast.parse(f.read(), path)


def _module_name(rel):
    parts = rel[:-3].split(os.sep)
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _absolute(rel, node):
    """The module an ImportFrom node names, resolved against the file `rel`."""
    if not node.level:
        return node.module
    package = _module_name(rel).split('.')
    if not rel.endswith('__init__.py'):
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return '.'.join(base + ([node.module] if node.module else []))


def _imports(rel, tree):
    """(module, imported name or None) of every import in the file, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(rel, node)
            for alias in node.names:
                yield module, alias.name


def _private(name):
    return name.startswith('_') and not (name.startswith('__') and name.endswith('__'))


def _top(module):
    return module.split('.')[0]


def _is_submodule(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_library_imports_neither_demo_nor_benchmarks():
    for rel, tree in _sources('mx_lbsgd'):
        for module, _ in _imports(rel, tree):
            assert _top(module) not in ('mx_lbsgd_demo', 'mx_lbsgd_bench'), (rel, module)


@pytest.mark.parametrize('package', ['mx_lbsgd_demo', 'mx_lbsgd_bench'])
def test_demo_and_benchmarks_use_public_api_only(package):
    public = set(mx_lbsgd.__all__)
    for rel, tree in _sources(package):
        for module, name in _imports(rel, tree):
            if _top(module) != 'mx_lbsgd':
                continue
            assert not any(_private(part) for part in module.split('.')), (rel, module)
            assert name is None or not _private(name), (rel, module, name)
            if module == 'mx_lbsgd' and name not in (None, '__version__'):
                assert name in public or _is_submodule('mx_lbsgd.' + name), (rel, name)
        for node in ast.walk(tree):      # mx_lbsgd._something
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == 'mx_lbsgd':
                assert not _private(node.attr), (rel, node.attr)


def test_benchmarks_use_public_names_of_the_demo_only():
    for rel, tree in _sources('mx_lbsgd_bench'):
        for module, name in _imports(rel, tree):
            if _top(module) != 'mx_lbsgd_demo':
                continue
            assert not any(_private(part) for part in module.split('.')), (rel, module)
            if name is not None:
                assert name in getattr(importlib.import_module(module), '__all__', ()), \
                    (rel, module, name)


def test_importing_the_library_imports_no_demo_module():
    """A fresh interpreter: mx_lbsgd and its public submodules load neither package."""
    code = ('import sys, pkgutil, importlib, mx_lbsgd\n'
            'for m in pkgutil.iter_modules(mx_lbsgd.__path__):\n'
            '    if not m.name.startswith("_"):\n'
            '        importlib.import_module("mx_lbsgd." + m.name)\n'
            'loaded = [m for m in sys.modules if m.split(".")[0] in '
            '("mx_lbsgd_demo", "mx_lbsgd_bench")]\n'
            'assert not loaded, loaded\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in [os.environ.get('PYTHONPATH')] if p]))
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr


def test_public_import_paths_of_earlier_versions_keep_working():
    """The modules moved into packages by concern; the paths users imported (and files
    pickled) before still give the same objects, and ``python -m mx_lbsgd.launch`` runs."""
    from mx_lbsgd.gluon import LossScaling, bind, init_kvstore
    from mx_lbsgd.launch import launch, main
    from mx_lbsgd.loss_scale import DynamicLossScaler, LossScaleStuckError
    from mx_lbsgd.overflow import LossScaleFallingWarning, OverflowReport
    from mx_lbsgd.lbsgd import LBSGD
    from mx_lbsgd.lamb import LAMB
    from mx_lbsgd.lssgd import LossScaledSGD
    assert LossScaling is mx_lbsgd.LossScaling and bind is mx_lbsgd.bind
    assert init_kvstore is mx_lbsgd.init_kvstore
    assert DynamicLossScaler is mx_lbsgd.DynamicLossScaler
    assert LossScaleStuckError is mx_lbsgd.LossScaleStuckError
    assert OverflowReport is mx_lbsgd.OverflowReport
    assert LossScaleFallingWarning is mx_lbsgd.LossScaleFallingWarning
    assert (LBSGD, LAMB, LossScaledSGD) == (mx_lbsgd.LBSGD, mx_lbsgd.LAMB,
                                             mx_lbsgd.LossScaledSGD)
    from mx_lbsgd.distributed import launch as moved
    assert (launch, main) == (moved.launch, moved.main)
    out = subprocess.run([sys.executable, '-m', 'mx_lbsgd.launch', '--help'],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and '--num-workers' in out.stdout + out.stderr, out
