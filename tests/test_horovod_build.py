"""The Horovod that scripts/install_horovod.sh builds carries
scripts/horovod-0.28.1-enqueue-name.patch: EnqueueTensorBroadcast and EnqueueTensorAlltoall
no longer read their `name` argument after the tensor is on Horovod's queue (Horovod
0.28.1's use-after-free under MXNet, docs/distributed/horovod-exit.md).

The source checks unpack the sdist that the script keeps in its cache (they skip, saying
so, where the script has not run); the installed build is told by its version, which the
script sets to 0.28.1+enqueuename.sha<the patch file's sha256, 10 digits>.
"""
import difflib
import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'install_horovod.sh')
PATCH = os.path.join(ROOT, 'scripts', 'horovod-0.28.1-enqueue-name.patch')
CACHE = os.environ.get('HOROVOD_BUILD_CACHE') or os.path.join(
    os.environ.get('XDG_CACHE_HOME') or os.path.expanduser(os.path.join('~', '.cache')),
    'mx_lbsgd', 'horovod')
SDIST = os.path.join(CACHE, 'sdist', 'horovod-0.28.1.tar.gz')
FIXED = ('EnqueueTensorBroadcast', 'EnqueueTensorAlltoall')


def patched_version():
    with open(PATCH, 'rb') as f:
        return '0.28.1+enqueuename.sha' + hashlib.sha256(f.read()).hexdigest()[:10]


def function_span(source, function):
    """(first, last) line index (0-based) of `function`'s definition in operations.cc."""
    lines = source.split('\n')
    first = next(i for i, line in enumerate(lines) if line.startswith('Status %s(' % function))
    last = next(i for i in range(first, len(lines)) if lines[i] == '}')
    return first, last


def name_read_after_enqueue(source, function):
    """The lines of `function` that read its `name` argument after AddToTensorQueue."""
    first, last = function_span(source, function)
    body = source.split('\n')[first:last + 1]
    enqueue = next(i for i, line in enumerate(body) if 'AddToTensorQueue(' in line)
    return [line.strip() for line in body[enqueue:] if re.search(r'\bname\b', line)]


@pytest.fixture(scope='module')
def sources(tmp_path_factory):
    """{'stock': operations.cc as released, 'patched': as the script builds it}."""
    if not os.path.exists(SDIST):
        pytest.skip('no Horovod sdist in the build cache (%s): scripts/install_horovod.sh '
                    'downloads it' % SDIST)
    found = {}
    for build, stock in (('stock', '1'), ('patched', '0')):
        folder = tmp_path_factory.mktemp(build)
        subprocess.run(['bash', SCRIPT, '--source', str(folder)], check=True,
                       capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable, HOROVOD_STOCK=stock,
                                HOROVOD_BUILD_CACHE=CACHE))
        path = folder / 'horovod-0.28.1' / 'horovod' / 'common' / 'operations.cc'
        found[build] = path.read_text(encoding='utf-8', errors='surrogateescape')
    return found


@pytest.mark.parametrize('function', FIXED)
def test_the_patch_copies_the_name_before_enqueuing(sources, function):
    """Released, the function logs `name` after enqueuing; patched, it logs a copy made
    before."""
    assert name_read_after_enqueue(sources['stock'], function) == \
        ['<< "Enqueued " << name;']
    assert name_read_after_enqueue(sources['patched'], function) == []


def test_the_patch_changes_nothing_else(sources):
    """Every line the patch adds or removes lies in one of the two functions."""
    spans = [function_span(sources['patched'], f) for f in FIXED]
    diff = difflib.unified_diff(sources['stock'].split('\n'),
                                sources['patched'].split('\n'), lineterm='', n=0)
    added = []
    for line in diff:
        hunk = re.match(r'@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@', line)
        if hunk:
            start, count = int(hunk.group(1)), int(hunk.group(2) or 1)
            added += list(range(start - 1, start - 1 + max(count, 1)))
    assert added
    outside = [i + 1 for i in added if not any(a <= i <= b for a, b in spans)]
    assert not outside, 'patched lines outside %s: %s' % (FIXED, outside)


@pytest.mark.horovod
def test_the_installed_horovod_is_the_patched_build():
    """The Horovod in this environment is the one scripts/install_horovod.sh builds with
    the patch in the repository (not Horovod as released: HOROVOD_STOCK=1, or pip)."""
    try:
        version = importlib.metadata.version('horovod')
    except importlib.metadata.PackageNotFoundError:
        pytest.skip('Horovod is not installed in this environment (bash '
                    'scripts/install_horovod.sh installs it)')
    assert version == patched_version(), (
        'horovod %s is installed; scripts/install_horovod.sh builds %s, with %s '
        '(rerun it with PYTHON=%s)' % (version, patched_version(),
                                       os.path.relpath(PATCH, ROOT), sys.executable))
