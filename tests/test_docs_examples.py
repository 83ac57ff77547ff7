"""Every fenced Python block of README.md and of the Markdown pages under docs/ runs.

The blocks of one page run in order in one interpreter and one namespace, as a reader
would paste them (a later block may use what an earlier one made), in a fresh temporary
directory. A block that needs several processes says so on the line before its fence:

    <!-- docs-test: horovod -->     run alone under ``horovodrun --gloo -np 2``
    <!-- docs-test: dist_sync -->   run alone under ``mx-lbsgd launch -n 2 -s 1``

Nothing is skipped: a page cannot opt a block out. Code that is not meant to run (a rule,
pseudo-code, output) goes in a ``text`` fence, not a ``python`` one.
"""
import glob
import os
import re
import subprocess
import sys

import pytest

from harness import horovodrun

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'docs', '_ext'))
from apicheck import unresolved_names  # noqa: E402  (the docs build's own name check)

pytestmark = pytest.mark.cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
_FENCE = re.compile(r'^(`{3,})(\S*)[^\n]*\n(.*?)^\1\s*$', re.M | re.S)
_MARK = re.compile(r'<!--\s*docs-test:\s*(\S+)\s*-->\s*$')
ENGINES = ('horovod', 'dist_sync')


def pages():
    """README.md and every Markdown page of the docs, relative to the repository root."""
    found = sorted(glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True))
    return ['README.md'] + [os.path.relpath(p, ROOT) for p in found
                            if os.sep + '_build' + os.sep not in p]


def python_blocks(page):
    """[(line, engine or None, code)] of the page's ``python`` fences."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    blocks = []
    for m in _FENCE.finditer(text):
        if m.group(2) not in ('python', 'py', 'python3', 'pycon'):
            continue
        assert m.group(2) == 'python', '%s: use ```python, not ```%s' % (page, m.group(2))
        line = text.count('\n', 0, m.start()) + 1
        before = text[:m.start()].rstrip('\n').rsplit('\n', 1)[-1]
        mark = _MARK.search(before)
        engine = mark.group(1) if mark else None
        assert engine in (None,) + ENGINES, '%s:%d: unknown docs-test mark %r' % (
            page, line, engine)
        blocks.append((line + 1, engine, m.group(3)))
    return blocks


def _script(page, blocks):
    """One program running `blocks` in order, each compiled under its page and line (and
    put in linecache) so that a traceback names and shows the line of the docs that failed."""
    return '\n'.join([
        'import linecache',
        'namespace = {"__name__": "__main__"}',
        'for line, code in %r:' % [(line, code) for line, _, code in blocks],
        '    source = "\\n" * (line - 1) + code',
        '    linecache.cache[%r] = (len(source), None, source.splitlines(True), %r)'
        % (page, page),
        '    exec(compile(source, %r, "exec"), namespace)' % page,
        '    print("docs-test: %s:%%d ran" %% line, flush=True)' % page]) + '\n'


def _env():
    env = dict(os.environ)
    env['PATH'] = BIN + os.pathsep + env.get('PATH', '')
    env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
    env.setdefault('MPLBACKEND', 'Agg')
    return env


LOCAL = [p for p in pages() if any(e is None for _, e, _ in python_blocks(p))]
JOBS = [(p, line, e) for p in pages() for line, e, _ in python_blocks(p) if e]


@pytest.mark.parametrize('page', pages())
def test_names_in_inline_code_exist(page):
    """The check the docs build runs on its pages (docs/_ext/apicheck.py), here also on the
    README, which the site does not include."""
    with open(os.path.join(ROOT, page)) as f:
        assert list(unresolved_names(f.read(), markdown=True)) == []


def test_the_name_check_finds_a_missing_function():
    text = ('Use `mx_lbsgd.LBSGD.set_learning_rate` and `mx_lbsgd.checkpoint.load_states(t, p)`,\n'
            'not `mx_lbsgd.checkpoint.load_state(t, p)` or `mx_lbsgd_demo.nothing`.\n'
            '```python\nmx_lbsgd.in_a_block_is_code_not_a_name\n```\n')
    assert list(unresolved_names(text, markdown=True)) == [
        (2, 'mx_lbsgd.checkpoint.load_state'), (2, 'mx_lbsgd_demo.nothing')]


def test_the_docs_have_python_examples():
    assert len(LOCAL) >= 10 and len(JOBS) >= 2, (LOCAL, JOBS)


@pytest.mark.parametrize('page', LOCAL)
def test_page_examples_run(page, tmp_path):
    blocks = [b for b in python_blocks(page) if b[1] is None]
    script = tmp_path / 'examples.py'
    script.write_text(_script(page, blocks))
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, '%s\n%s' % (proc.stdout[-3000:], proc.stderr[-6000:])
    assert proc.stdout.count('docs-test: %s:' % page) == len(blocks)


def _job_script(page, line, tmp_path):
    """The block of `page` at `line`, alone, as a script for a 2-process job."""
    script = tmp_path / 'example.py'
    script.write_text(_script(page, [b for b in python_blocks(page) if b[0] == line]))
    return str(script)


def _ran_on_both(proc, page, line):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count('docs-test: %s:%d ran' % (page, line)) == 2


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.parametrize('page,line', [(p, n) for p, n, e in JOBS if e == 'horovod'])
def test_horovod_examples_run(page, line, tmp_path):
    proc = horovodrun([os.path.join(BIN, 'horovodrun'), '--gloo', '-np', '2', '-H',
                       'localhost:2', sys.executable, _job_script(page, line, tmp_path)],
                      timeout=300, cwd=str(tmp_path), env=_env(), stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    _ran_on_both(proc, page, line)


@pytest.mark.multiprocess
@pytest.mark.parametrize('page,line', [(p, n) for p, n, e in JOBS if e == 'dist_sync'])
def test_dist_sync_examples_run(page, line, tmp_path):
    proc = subprocess.run([sys.executable, '-m', 'mx_lbsgd.launch', '-n', '2', '-s', '1',
                           '--timeout', '240', '--', sys.executable,
                           _job_script(page, line, tmp_path)],
                          cwd=str(tmp_path), env=_env(), capture_output=True, text=True,
                          timeout=300)
    _ran_on_both(proc, page, line)
