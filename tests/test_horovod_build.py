"""The Horovod that scripts/install_horovod.sh builds carries three patches
(docs/distributed/horovod-exit.md, docs/distributed/sharded.md):
- scripts/horovod-0.28.1-enqueue-name.patch: EnqueueTensorBroadcast and
  EnqueueTensorAlltoall no longer read their `name` argument after the tensor is on
  Horovod's queue (Horovod 0.28.1's use-after-free under MXNet);
- scripts/horovod-0.28.1-lost-peer-exit.patch: when the background loop fails (a peer
  lost), the process ends with status 1 instead of failing the queued collectives into
  MXNet's engine, whose exception list has no lock;
- scripts/horovod-0.28.1-ring-reducescatter.patch: a reduce-scatter of one tensor on gloo
  runs as a ring from the input into the output (0.28.1 copies the tensor and allocates
  and zero-fills two more buffers of its size on every call).

The source checks unpack the sdist that the script keeps in its cache (they skip, saying
so, where the script has not run); the installed build is told by its version, which the
script sets to 0.28.1+mxlbsgd.sha<sha256 of the patch files concatenated, 10 digits>.
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
PATCHES = [os.path.join(ROOT, 'scripts', 'horovod-0.28.1-%s.patch' % name)
           for name in ('enqueue-name', 'lost-peer-exit', 'ring-reducescatter')]
CACHE = os.environ.get('HOROVOD_BUILD_CACHE') or os.path.join(
    os.environ.get('XDG_CACHE_HOME') or os.path.expanduser(os.path.join('~', '.cache')),
    'mx_lbsgd', 'horovod')
SDIST = os.path.join(CACHE, 'sdist', 'horovod-0.28.1.tar.gz')
FIXED = ('EnqueueTensorBroadcast', 'EnqueueTensorAlltoall')


LOOP_FAILED = 'Horovod background loop uncaught exception'


def patched_version():
    digest = hashlib.sha256()
    for path in PATCHES:
        with open(path, 'rb') as f:
            digest.update(f.read())
    return '0.28.1+mxlbsgd.sha' + digest.hexdigest()[:10]


def function_span(source, function):
    """(first, last) line index (0-based) of `function`'s definition in operations.cc."""
    lines = source.split('\n')
    first = next(i for i, line in enumerate(lines) if line.startswith('Status %s(' % function))
    last = next(i for i in range(first, len(lines)) if lines[i] == '}')
    return first, last


def loop_failure_span(source):
    """(first, last) line index of the catch block after BackgroundThreadLoop's loop."""
    lines = source.split('\n')
    logged = next(i for i, line in enumerate(lines) if LOOP_FAILED in line)
    first = max(i for i in range(logged) if lines[i].strip().startswith('} catch ('))
    last = next(i for i in range(logged, len(lines)) if lines[i] == '  }')
    return first, last


def name_read_after_enqueue(source, function):
    """The lines of `function` that read its `name` argument after AddToTensorQueue."""
    first, last = function_span(source, function)
    body = source.split('\n')[first:last + 1]
    enqueue = next(i for i, line in enumerate(body) if 'AddToTensorQueue(' in line)
    return [line.strip() for line in body[enqueue:] if re.search(r'\bname\b', line)]


@pytest.fixture(scope='module')
def sources(tmp_path_factory):
    """{'stock': operations.cc as released, 'patched': as the script builds it, and the
    same of ops/gloo_operations.cc and .h as 'stock <name>', 'patched <name>'}."""
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
        common = folder / 'horovod-0.28.1' / 'horovod' / 'common'
        found[build] = (common / 'operations.cc').read_text(encoding='utf-8',
                                                           errors='surrogateescape')
        for name in ('gloo_operations.cc', 'gloo_operations.h'):
            found['%s %s' % (build, name)] = (common / 'ops' / name).read_text(
                encoding='utf-8', errors='surrogateescape')
    return found


def _added_lines(stock, patched):
    """0-based indices in `patched` of the lines the diff adds or replaces."""
    added = []
    for line in difflib.unified_diff(stock.split('\n'), patched.split('\n'), lineterm='',
                                     n=0):
        hunk = re.match(r'@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@', line)
        if hunk:
            start, count = int(hunk.group(1)), int(hunk.group(2) or 1)
            added += list(range(start - 1, start - 1 + count))
    return added


def test_the_ring_patch_changes_only_the_reducescatter(sources):
    """gloo_operations.cc: the lines the ring patch adds lie in the two RingReducescatter
    definitions (bool refuses, as Reducescatter does) and in GlooReducescatter::Execute, or
    are two includes; the header only declares RingReducescatter."""
    patched = sources['patched gloo_operations.cc'].split('\n')
    spans = []
    for i, line in enumerate(patched):
        if '::RingReducescatter(' in line or line.startswith('Status GlooReducescatter::'):
            first = max(k for k in range(i + 1) if patched[k].startswith('template <') or
                        patched[k].startswith('Status '))
            spans.append((first, next(k for k in range(i, len(patched)) if patched[k] == '}')))
    assert len(spans) == 3, spans
    added = _added_lines(sources['stock gloo_operations.cc'], '\n'.join(patched))
    loose = [patched[i] for i in added if not any(a - 8 <= i <= b for a, b in spans)]
    assert added and all(line in ('', '#include <algorithm>', '#include <cstring>')
                         or line.startswith('//') for line in loose), loose
    header = sources['patched gloo_operations.h'].split('\n')
    declared = [header[i].strip() for i in _added_lines(sources['stock gloo_operations.h'],
                                                        '\n'.join(header))]
    assert {line.split('(')[0] for line in declared if line} <= {
        'virtual void RingReducescatter', 'void RingReducescatter',
        'std::vector<int>& recvcounts) = 0;', 'std::vector<int>& recvcounts) override;'}, declared
    assert sources['stock gloo_operations.cc'].count('RingReducescatter') == 0


@pytest.mark.parametrize('function', FIXED)
def test_the_patch_copies_the_name_before_enqueuing(sources, function):
    """Released, the function logs `name` after enqueuing; patched, it logs a copy made
    before."""
    assert name_read_after_enqueue(sources['stock'], function) == \
        ['<< "Enqueued " << name;']
    assert name_read_after_enqueue(sources['patched'], function) == []


def test_the_loop_failure_ends_the_process(sources):
    """Released, the catch block after a failed background loop only logs, and the
    shutdown that follows fails every queued collective into MXNet; patched, the block
    ends the process (std::_Exit(1)) after saying why."""
    blocks = {}
    for build in ('stock', 'patched'):
        first, last = loop_failure_span(sources[build])
        blocks[build] = [line.strip() for line in sources[build].split('\n')[first:last + 1]]
    assert not [line for line in blocks['stock'] if '_Exit' in line]
    assert blocks['patched'][-2:] == ['std::_Exit(1);', '}'], blocks['patched']
    assert any('ending this process with status 1' in line for line in blocks['patched'])


def test_the_patches_change_nothing_else(sources):
    """Every line the patches add or remove lies in one of the two functions, in the catch
    block of the failed loop, or is the include of <cstdlib> (for std::_Exit)."""
    patched = sources['patched'].split('\n')
    spans = [function_span(sources['patched'], f) for f in FIXED]
    spans.append(loop_failure_span(sources['patched']))
    spans += [(i, i) for i, line in enumerate(patched) if line == '#include <cstdlib>']
    assert len(spans) == len(FIXED) + 2
    diff = difflib.unified_diff(sources['stock'].split('\n'), patched, lineterm='', n=0)
    added = []
    for line in diff:
        hunk = re.match(r'@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@', line)
        if hunk:
            start, count = int(hunk.group(1)), int(hunk.group(2) or 1)
            added += list(range(start - 1, start - 1 + max(count, 1)))
    assert added
    outside = [i + 1 for i in added if not any(a <= i <= b for a, b in spans)]
    assert not outside, 'patched lines outside %s, the loop\'s catch block and the ' \
        'include: %s' % (FIXED, outside)


@pytest.mark.horovod
def test_the_installed_horovod_is_the_patched_build():
    """The Horovod in this environment is the one scripts/install_horovod.sh builds with
    the patches in the repository (not Horovod as released: HOROVOD_STOCK=1, or pip)."""
    try:
        version = importlib.metadata.version('horovod')
    except importlib.metadata.PackageNotFoundError:
        pytest.skip('Horovod is not installed in this environment (bash '
                    'scripts/install_horovod.sh installs it)')
    assert version == patched_version(), (
        'horovod %s is installed; scripts/install_horovod.sh builds %s, with %s '
        '(rerun it with PYTHON=%s)' % (version, patched_version(),
                                       ' and '.join(os.path.relpath(p, ROOT) for p in PATCHES),
                                       sys.executable))
