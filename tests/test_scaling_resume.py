"""Resuming ``lr_scaling='adascale'`` and ``batch_scale='auto'`` from `mx_lbsgd.checkpoint`
files on Horovod's DistributedTrainer and on `mx_lbsgd.ShardedTrainer` (2 ranks), and at
another world size (2 ranks -> 1 process, 1 process -> 2 ranks).

Two horovodrun jobs of tests/scaling_resume_worker.py serve every test (module fixture
`jobs`): the first runs each scenario uninterrupted and, in a fresh run, to a save point
where it saves; the second is a fresh job that loads those files and trains on. One-process
runs (save for 1 -> 2, load for 2 -> 1) run in this process. The problem is the noisy linear
regression of tests/test_lr_scaling.py with per-rank seeded data, whose rng state the
resumed run restores; 'auto' windows are timed by tests/test_batch_choice.py's virtual
clock, so that the uninterrupted and the resumed run see the same window times.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.horovod]

pytest.importorskip('horovod.mxnet')

from harness import HOROVODRUN, horovodrun  # noqa: E402
import scaling_resume_worker as worker  # noqa: E402

WORKER = os.path.abspath(worker.__file__)
ADA = dict(batch_scale=2, total=40)
AUTO = dict(batch_scale='auto', bounds=[1, 8], interval=2, total=160)
LBSGD = dict(optimizer='lbsgd')          # momentum 0.9 (worker.optimizer_args)
LBLAMB = dict(optimizer='lblamb')

#: saved and resumed on 2 ranks, bit for bit (stop: the first micro-batch count >= after at
#: a window boundary, or inside a window)
TWO_RANKS = {
    'hvd_ada_mid': dict(ADA, **LBSGD, kind='horovod', stop=dict(after=21, where='mid')),
    'hvd_ada_edge': dict(ADA, **LBSGD, kind='horovod', stop=dict(after=20, where='boundary')),
    'hvd_auto_mid': dict(AUTO, **LBSGD, kind='horovod', stop=dict(after=60, where='mid')),
    # saved with a length chosen and not yet in effect (pending), which the resumed job takes
    'hvd_auto_edge': dict(AUTO, **LBSGD, kind='horovod', stop=dict(after=60, where='boundary'),
                          pending_at_save=True),
    # after=21 is inside a window of 2: the ShardedTrainer refuses, then saves at 22
    'sharded_lblamb_ada': dict(ADA, **LBLAMB, kind='sharded', stop=dict(after=21,
                                                                      where='boundary')),
    'sharded_lbsgd_ada': dict(ADA, **LBSGD, kind='sharded', stop=dict(after=21,
                                                                    where='boundary')),
    'sharded_lblamb_auto': dict(AUTO, **LBLAMB, kind='sharded', stop=dict(after=20,
                                                                          where='boundary')),
    'sharded_lbsgd_auto': dict(AUTO, **LBSGD, kind='sharded', stop=dict(after=60,
                                                                      where='boundary'),
                               pending_at_save=True),
}
#: saved in one process (here), resumed on 2 ranks
ONE_PROCESS = {
    'one_ada': dict(ADA, **LBSGD, kind='gluon', stop=dict(after=20, where='boundary')),
    'one_auto': dict(AUTO, **LBLAMB, kind='gluon', stop=dict(after=30, where='boundary')),
}
TO_TWO = {
    'one_ada.hvd': dict(ADA, **LBSGD, kind='horovod', saved='one_ada'),
    'one_auto.sharded': dict(AUTO, **LBLAMB, kind='sharded', saved='one_auto'),
}
#: what a bit-for-bit resume must give (besides the weights)
SAME = ('scale_invariant_steps', 'last_gain', 'piece', 'window_history', 'batch_scale',
        'micro_batches', 'applied_updates')
#: and with 'auto' (the chooser's timings but for their counts: the window across the
#: restart is not timed, and the virtual clock's equal times leave every mean as it was)
SAME_AUTO = ('timings', 'pending', 'since_choice')


def _scenarios(table):
    return [dict(sc, name=name) for name, sc in table.items()]


def _run_job(phase, scenarios, out):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(WORKER)), os.path.dirname(WORKER),
        os.environ.get('PYTHONPATH')])))
    job = json.dumps(dict(phase=phase, scenarios=scenarios))
    proc = horovodrun([HOROVODRUN, '--gloo', '-np', '2', '-H', 'localhost:2',
                       sys.executable, WORKER, job, str(out)],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                      timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-5000:]


@pytest.fixture(scope='module')
def jobs(tmp_path_factory):
    """The folder of both jobs' files (run once; a failure fails every test, no retry)."""
    out = tmp_path_factory.mktemp('scaling_resume')
    _run_job('first', _scenarios(TWO_RANKS), out)
    for sc in _scenarios(ONE_PROCESS):
        worker.run_until(sc, str(out), 0)
    second = [dict(sc, resume=dict(name=sc['name'], per_rank=sc['stop']['where'] == 'mid'))
              for sc in _scenarios(TWO_RANKS)]
    second += [dict(sc, resume=dict(name=sc['saved'], reseed=True), record_first=True)
               for sc in _scenarios(TO_TWO)]
    _run_job('second', second, out)
    return out


def _read(folder, name, kind, rank):
    with open(str(folder / ('%s.r%d.%s.json' % (name, rank, kind)))) as f:
        return json.load(f)


def _differing(a, b, keys):
    return {k: (a[k], b[k]) for k in keys if a[k] != b[k]}


def _keys(sc):
    return SAME + (SAME_AUTO if sc['batch_scale'] == 'auto' else ())


def _check_bit_for_bit(folder, name, sc):
    """The resumed run equals the uninterrupted one on every rank, and the ranks agree."""
    keys = _keys(sc)
    for rank in range(2):
        whole = _read(folder, name, 'whole', rank)
        saved = _read(folder, name, 'saved', rank)
        resumed = _read(folder, name, 'resumed', rank)
        # the file gave the optimizer what the saving run held
        assert _differing(resumed['loaded'], saved, keys) == {}
        assert resumed['loaded']['window_position'] == saved['window_position']
        # then it trained on as the uninterrupted run did, bit for bit
        assert whole['weight'] == resumed['weight'] and whole['bias'] == resumed['bias']
        assert _differing(whole, resumed, keys) == {}
        after = [g for g in whole['gains'] if g[0] > saved['applied_updates']]
        assert [tuple(g) for g in resumed['gains']] == [tuple(g) for g in after]
        # it could have failed: the resumed part applied updates whose gains move
        assert len(after) >= 8 and len({g for _, g in after}) == len(after)
        assert min(g for _, g in after) > 1.2
        if sc['batch_scale'] == 'auto':
            # the resumed part took a window length the saved run had not started
            assert len(whole['window_history']) > len(saved['window_history'])
            # one window (the one across the restart) was not timed
            assert sum(whole['timing_counts']) - sum(resumed['timing_counts']) == 1
            if sc.get('pending_at_save'):
                assert saved['pending'] is not None and saved['pending'] != saved['batch_scale']
    first = [_read(folder, name, 'resumed', r) for r in range(2)]
    assert _differing(first[0], first[1], keys + ('weight', 'bias', 'gains')) == {}
    return [_read(folder, name, 'saved', r) for r in range(2)]


@pytest.mark.parametrize('name', [n for n, sc in TWO_RANKS.items() if sc['kind'] == 'horovod'])
def test_distributed_trainer_resumes_bit_for_bit(jobs, name):
    """hvd.DistributedTrainer, 2 ranks, 'lbsgd' momentum 0.9 with 'adascale' at
    batch_scale=2 or 'auto' in (1, 8): saved inside a window (every rank its own file) or at
    a boundary (rank 0's file, loaded on every rank), loaded in a fresh job: the weights,
    scale_invariant_steps, last_gain, the gain's estimates, the window history (and the
    chooser's timings) equal the uninterrupted run's on both ranks; the resumed part
    applied gains > 1 that change each update, and ('auto') changed the window."""
    sc = TWO_RANKS[name]
    saved = _check_bit_for_bit(jobs, name, sc)
    inside = sc['stop']['where'] == 'mid'
    assert all(bool(s['window_position']) == inside for s in saved)
    assert all(s['per_rank'] == inside for s in saved)
    if inside:       # each rank kept its own window: the small norms it had taken
        assert os.path.exists(str(jobs / ('%s.r1.states' % name)))


@pytest.mark.parametrize('name', [n for n, sc in TWO_RANKS.items() if sc['kind'] == 'sharded'])
def test_sharded_trainer_resumes_bit_for_bit(jobs, name):
    """mx_lbsgd.ShardedTrainer, 2 ranks, 'lblamb' and 'lbsgd' (momentum 0.9) with
    'adascale' at batch_scale=2 or 'auto' in (1, 8): its consolidated save_states at a
    window boundary, loaded by a fresh job's load_states: everything equals the
    uninterrupted run's on both ranks, as for the DistributedTrainer; a save inside a
    window was refused first (the 'adascale' runs stop inside one)."""
    sc = TWO_RANKS[name]
    saved = _check_bit_for_bit(jobs, name, sc)
    assert all(s['window_position'] == 0 for s in saved)
    if sc['batch_scale'] == 2:
        assert all('save at a window boundary' in s['refused'] for s in saved)


# -- another world size --------------------------------------------------------------------
def _gradients(weight, bias, data):
    """float64 mean per-example gradients of 1/2 (x.w + b - y)^2, per micro-batch."""
    w, b = np.array(weight, np.float64), np.array(bias, np.float64)
    out = []
    for x, y in data:
        x, y = np.array(x, np.float64), np.array(y, np.float64)
        e = x @ w.T + b - y
        out.append(np.concatenate([(e.T @ x).ravel(), e.sum(axis=0)]) / len(x))
    return out


def _reference(first_by_rank, moments, power):
    """(gain, r, S, r at any S) of the first update after a resume at len(first_by_rank)
    workers, float64: AdaScale's r = (sigma2 + mu2) / (sigma2 / S + mu2) from the restored moving
    averages, after they take this update's estimate (lr_scaling.py: the moments of the
    mean small and the big squared norms, weighed with smoothing ** S, bias-corrected by the
    weights' sum), S = window length x workers, sigma2 = tr(Sigma) / b."""
    workers = len(first_by_rank)
    length = first_by_rank[0]['length']
    grads = [g for f in first_by_rank for g in _gradients(f['weight'], f['bias'], f['data'])]
    assert len(grads) == workers * length
    b = worker.B
    small = np.mean([g @ g for g in grads])
    mean = np.mean(grads, axis=0)
    big = mean @ mean
    b_small, b_big = float(b), float(b * workers * length)
    g2 = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1.0 / b_small - 1.0 / b_big)
    scale = float(length * workers)
    decay = worker.SMOOTHING ** scale
    assert not moments['biased']
    g2_sum = decay * moments['g2_sum'] + (1 - decay) * g2
    trace_sum = decay * moments['trace_sum'] + (1 - decay) * trace
    weight = decay * moments['weight'] + (1 - decay)

    def r_at(s):
        mu2, sigma2 = max(g2_sum / weight, 0.0), max(trace_sum / weight, 0.0) / b
        return (sigma2 + mu2) / (sigma2 / s + mu2)
    return r_at(scale) ** power, r_at(scale), scale, r_at


def _check_first_update(first_by_rank, saved, power):
    """The first update after the resume takes AdaScale's gain at the new S, from the
    restored estimates; it is not the gain at the saved S."""
    gain, r, scale, r_at = _reference(first_by_rank, saved['piece']['moments'], power)
    assert scale != saved['piece']['last_scale']
    for first in first_by_rank:
        after = first['after']
        assert after['last_gain'] == pytest.approx(gain, rel=1e-6, abs=0)
        assert after['piece']['last_scale'] == scale
        assert after['scale_invariant_steps'] - saved['scale_invariant_steps'] == \
            pytest.approx(r, rel=1e-6, abs=0)
        assert after['piece']['moments']['samples'] == saved['piece']['moments']['samples'] + 1
    # the tolerance tells the new S from the saved one, and r from 1
    assert abs(r_at(saved['piece']['last_scale']) / r - 1) > 1e-3 and r > 1.2


def _check_windows_continue(history, saved, bounds):
    """The window lengths go on from the saved ones, inside the bounds, at most 2x per
    change, and change after the resume."""
    assert [tuple(h) for h in history[:len(saved['window_history'])]] == \
        [tuple(h) for h in saved['window_history']]
    lengths = [n for _, n in history]
    assert all(bounds[0] <= n <= bounds[1] for n in lengths)
    assert all(b <= 2 * a and a <= 2 * b for a, b in zip(lengths, lengths[1:]))
    assert len(history) > len(saved['window_history']), history


@pytest.mark.parametrize('name', ['hvd_ada_edge', 'hvd_auto_edge', 'sharded_lblamb_ada',
                                  'sharded_lbsgd_auto'])
def test_two_ranks_resume_in_one_process(jobs, name):
    """The file of 2 ranks (DistributedTrainer: rank 0's at a boundary; ShardedTrainer: its
    consolidated file) loaded into a 1-process gluon.Trainer: the estimates, progress, last
    gain, window history and chooser state equal the saved ones; the first update's gain is
    AdaScale's r (LAMB: sqrt(r)) at S = window x 1 from them (float64 reference); 'auto'
    goes on choosing windows inside the bounds."""
    sc = dict(TWO_RANKS[name], kind='gluon', name=name + '.to1',
              resume=dict(name=name, dir=str(jobs), reseed=True))
    saved = _read(jobs, name, 'saved', 0)
    run, loaded = worker.resume(sc, str(jobs), 0)
    loaded = json.loads(json.dumps(loaded))          # as the jobs' files hold it
    assert _differing(loaded, saved, _keys(sc)) == {}
    assert loaded['window_position'] == 0
    first = worker.first_update(run)
    assert first['length'] > 1         # not S = 1's difference estimator
    power = 0.5 if sc['optimizer'] == 'lblamb' else 1.0
    _check_first_update([first], saved, power)
    if sc['batch_scale'] == 'auto':
        run.train(lambda o: o.micro_batches < sc['total'] + saved['micro_batches'])
        _check_windows_continue(run.opt.window_history, saved, sc['bounds'])


@pytest.mark.parametrize('name', list(TO_TWO))
def test_one_process_resumes_on_two_ranks(jobs, name):
    """A 1-process gluon.Trainer's file ('lbsgd' 'adascale' at batch_scale=2; 'lblamb'
    'auto' in (1, 8)) loaded on 2 ranks (DistributedTrainer; ShardedTrainer): both ranks
    hold the saved estimates, progress and windows, and take the same first gain, AdaScale's
    at S = window x 2 from them and both ranks' gradients (float64 reference); 'auto' goes
    on choosing windows inside the bounds, the same on both ranks."""
    sc = TO_TWO[name]
    saved = _read(jobs, sc['saved'], 'saved', 0)
    resumed = [_read(jobs, name, 'resumed', r) for r in range(2)]
    for result in resumed:
        assert _differing(result['loaded'], saved, _keys(sc)) == {}
        assert result['first']['length'] > 1
    power = 0.5 if sc['optimizer'] == 'lblamb' else 1.0
    _check_first_update([r['first'] for r in resumed], saved, power)
    keys = _keys(sc) + ('weight', 'bias', 'gains')
    assert _differing(resumed[0], resumed[1], keys) == {}
    assert resumed[0]['first']['data'] != resumed[1]['first']['data']
    if sc['batch_scale'] == 'auto':
        _check_windows_continue(resumed[0]['window_history'], saved, sc['bounds'])
