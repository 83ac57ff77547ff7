"""``mx-lbsgd mlm --resume`` as the docs show it, and damaged checkpoints (issue 31).

The lines of the masked-LM block of docs/guide/bert-lamb.md run in order, taken from the page
itself (a change there changes what is tested), each with the same small model appended so
that the job takes seconds."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: appended to every docs line: a small model (the page's schedule, 200 updates of 4
#: micro-batches, and its --out / --stop-after / --resume stay as written)
SMALL = ['--vocab', '16', '--hidden', '16', '--layers', '1', '--heads', '2', '--seq-len', '8',
         '--batch-size', '4']


def _env():
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([ROOT] + [p for p in [env.get('PYTHONPATH')] if p])
    return env


def _readme_mlm_lines():
    """The ``mx-lbsgd mlm`` lines of the docs' masked-LM code block, in order, as argv
    lists (comments dropped; the horovodrun line is test_mlm.py's horovod tests' job)."""
    with open(os.path.join(ROOT, 'docs', 'guide', 'bert-lamb.md')) as f:
        text = f.read()
    section = text[text.index('`mx-lbsgd mlm`'):]
    block = re.search(r'```bash\n(.*?)```', section, re.S).group(1)
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [line[1:] for line in lines if line[:2] == ['mx-lbsgd', 'mlm']]


def _mlm(cwd, argv):
    return subprocess.run([sys.executable, '-m', 'mx_lbsgd_demo'] + argv + SMALL, cwd=str(cwd),
                          env=_env(), capture_output=True, text=True, timeout=900)


def _summary(cwd, out):
    with open(os.path.join(str(cwd), out, 'summary.json')) as f:
        return json.load(f)


def _out(argv):
    return argv[argv.index('--out') + 1]


def test_readme_resume_example_resumes(tmp_path):
    """Full run; interrupted run into the same folder (its summary says unfinished, the
    finished one's numbers are not passed off as its own); --resume OUT continues the
    interrupted run from the checkpoint it wrote, to the full run's bits; resuming the
    finished run again is refused in one line."""
    full, stopped, resumed = _readme_mlm_lines()
    assert '--resume' not in full and '--stop-after' in stopped and '--resume' in resumed
    out = _out(full)
    assert _out(stopped) == out and _out(resumed) == out

    run = _mlm(tmp_path, full)
    assert run.returncode == 0, run.stderr
    finished = _summary(tmp_path, out)
    assert finished['finished'] and finished['updates'] == finished['steps']

    run = _mlm(tmp_path, stopped)
    assert run.returncode == 0, run.stderr
    stop = int(stopped[stopped.index('--stop-after') + 1])
    partial = _summary(tmp_path, out)
    assert partial['finished'] is False and partial['micro_batches'] == stop
    assert partial['updates'] == stop // partial['batch_scale'] < finished['updates']
    assert 'stopped after micro-batch %d' % stop in run.stdout
    checkpoint = os.path.join(out, 'checkpoints', 'micro-batch-%07d' % stop)
    assert checkpoint in run.stdout and '--resume' in run.stdout

    run = _mlm(tmp_path, resumed)
    assert run.returncode == 0, run.stderr
    assert 'resuming from %s: micro-batch %d' % (checkpoint, stop) in run.stdout
    again = _summary(tmp_path, out)
    assert again['finished'] and again['checkpoint'].endswith('micro-batch-%07d' % (
        finished['steps'] * finished['batch_scale']))
    # bit for bit: the same parameters, loss curve and evaluation as the full run
    assert again['param_sha256_per_rank'] == finished['param_sha256_per_rank']
    assert again['loss_curve'] == finished['loss_curve']
    assert again['eval_after'] == finished['eval_after']

    run = _mlm(tmp_path, resumed)          # the run is finished: nothing to resume
    assert run.returncode == 2
    err = run.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('mx-lbsgd mlm: error: argument --resume: ')
    assert 'finished' in err[0] and 'Traceback' not in run.stderr
    assert _summary(tmp_path, out) == again


@pytest.fixture(scope='module')
def stopped_run(tmp_path_factory):
    """A run stopped inside a window (rank states) and one at a window boundary."""
    root = tmp_path_factory.mktemp('stopped')
    base = ['mlm', '--steps', '4', '--warmup', '1', '--batch-scale', '2', '--quiet']
    for name, stop in (('mid', '3'), ('boundary', '4')):
        run = _mlm(root, base + ['--out', name, '--stop-after', stop])
        assert run.returncode == 0, run.stderr
    return root, base


def _damage(path, how):
    if how == 'truncated':
        with open(path, 'rb') as f:
            data = f.read()
        with open(path, 'wb') as f:
            f.write(data[:len(data) // 2])
    else:
        os.remove(path)


@pytest.mark.parametrize('run, name, how', [
    ('boundary', 'model.params', 'truncated'),
    ('boundary', 'progress.json', 'truncated'),
    ('boundary', 'trainer.states', 'truncated'),
    ('mid', 'trainer.rank0.states', 'truncated'),
    ('boundary', 'trainer.states', 'missing'),
])
def test_damaged_checkpoint_is_one_line_naming_the_file(stopped_run, tmp_path, run, name,
                                                        how):
    root, base = stopped_run
    folder = tmp_path / run
    subprocess.run(['cp', '-r', str(root / run), str(folder)], check=True)
    checkpoint = folder / 'checkpoints' / ('micro-batch-%07d' % (3 if run == 'mid' else 4))
    _damage(str(checkpoint / name), how)
    before = sorted(os.listdir(str(checkpoint)))
    result = _mlm(tmp_path, base + ['--out', str(folder), '--resume', str(folder)])
    assert result.returncode == 2, result.stdout + result.stderr
    err = result.stderr.strip().splitlines()
    assert len(err) == 1, result.stderr
    assert err[0].startswith('mx-lbsgd mlm: error: argument --resume: ')
    # the file the user has to look at, by its path
    missing_states = how == 'missing'
    assert str(checkpoint / ('trainer.rank0.states' if missing_states else name)) in err[0]
    assert sorted(os.listdir(str(checkpoint))) == before      # nothing written
