"""Overflow reports: what a skipped loss-scaled step says, where it is kept, what it costs on
finite steps (nothing but the window's per-micro-batch flag), the early warning, and who can
know what on a 2-worker job."""
import io
import json
import logging
import os
import sys
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

import mx_lbsgd
from mx_lbsgd import DynamicLossScaler, LossScaleFallingWarning, LossScaleStuckError
from mx_lbsgd import _kernels, _compat, _native
from mx_lbsgd.counting import count_host_syncs, count_kernel_launches
from mx_lbsgd.launch import launch

import dist_worker
from harness import flag_read, horovodrun

pytestmark = [pytest.mark.unit, pytest.mark.fallback]

SHAPES = {'p0': (4, 3), 'p1': (5,), 'p2': (3, 3)}
INIT = 64.0


def make_params(dtype):
    rng = np.random.RandomState(0)
    params = gluon.ParameterDict()
    for name, shape in SHAPES.items():
        p = params.get(name, shape=shape, dtype=dtype)
        p.initialize(ctx=mx.cpu())
        p.set_data(nd.array(rng.uniform(-1, 1, shape), dtype=dtype))
    return params


def backward(params, step, scale):
    with autograd.record():
        loss = nd.add_n(*[(p.data().astype('float32') * (1 + 0.1 * ((i + step) % 5))).square()
                          .sum() for i, p in enumerate(params.values())])
        loss = loss * scale
    loss.backward()


def inject(grad, value, n):
    """Write `value` into the first `n` elements of `grad`."""
    a = grad.asnumpy()
    a.flat[:n] = value
    grad[:] = nd.array(a, dtype=grad.dtype)


def scaler():
    return DynamicLossScaler(init_scale=INIT, growth_interval=100)


def train(trainer, params, steps, injections, source, step=None):
    """`injections`: {loop step: [(param, value, n)]}. Returns source.last_overflow after
    every loop step. `step(trainer)` replaces trainer.step(1) (the hook)."""
    reports = []
    for s in range(steps):
        scale = source.loss_scaler.scale if hasattr(source, 'loss_scaler') else source.scale
        backward(params, s, scale)
        for name, value, n in injections.get(s, ()):
            inject(params[name].grad(), value, n)
        (step or (lambda t: t.step(1)))(trainer)
        reports.append(source.last_overflow)
    return reports


# optimizer, its params, dtype, in-optimizer window, injections, the loop step that
# reports, expected (step, micro_batch, {name: (kind, count)})
OPTIMIZER_CASES = [
    pytest.param('lssgd', {}, 'float32', False, {2: [('p1', np.inf, 2)]},
                 2, (3, None, {'p1': ('inf', 2)}), id='lssgd-fp32-inf'),
    pytest.param('lssgd', dict(multi_precision=True), 'float16', False,
                 {1: [('p0', np.nan, 3)]}, 1, (2, None, {'p0': ('nan', 3)}),
                 id='lssgd-fp16-nan'),
    pytest.param('lssgd', {}, 'float32', False,
                 {0: [('p2', np.inf, 1), ('p0', np.nan, 4)]}, 0,
                 (1, None, {'p0': ('nan', 4), 'p2': ('inf', 1)}), id='lssgd-two-params'),
    pytest.param('lbsgd', dict(batch_scale=4, warmup_epochs=0), 'float32', False,
                 {6: [('p2', np.inf, 1)]}, 7, (2, 3, {'p2': ('inf', 1)}),
                 id='lbsgd-B4-fp32-trainer-window-mb3'),
    pytest.param('lbsgd', dict(batch_scale=4, warmup_epochs=0, multi_precision=True),
                 'float16', False, {0: [('p1', np.nan, 5)]}, 3,
                 (1, 1, {'p1': ('nan', 5)}), id='lbsgd-B4-fp16-trainer-window-mb1'),
    # +inf at micro-batch 1 and -inf at micro-batch 2 on one element: the mean is nan
    pytest.param('lbsgd', dict(batch_scale=4, warmup_epochs=0), 'float32', False,
                 {0: [('p0', np.inf, 1)], 1: [('p0', -np.inf, 1)]}, 3,
                 (1, 1, {'p0': ('nan', 1)}), id='lbsgd-B4-inf-minus-inf-is-nan'),
    pytest.param('lblamb', dict(batch_scale=2, learning_rate=0.01), 'float32', False,
                 {3: [('p2', np.inf, 2)]}, 3, (2, 2, {'p2': ('inf', 2)}),
                 id='lblamb-B2-fp32-mb2'),
    pytest.param('lbsgd', dict(batch_scale=2, warmup_epochs=0), 'float32', True,
                 {3: [('p1', np.inf, 1)]}, 3, (4, 2, {'p1': ('inf', 1)}),
                 id='lbsgd-B2-in-optimizer-window-mb2'),
]


@pytest.mark.parametrize('optimizer, extra, dtype, in_optimizer, injections, at, expected',
                         OPTIMIZER_CASES)
def test_optimizer_report_fields(optimizer, extra, dtype, in_optimizer, injections, at,
                                 expected):
    params = make_params(dtype)
    trainer = gluon.Trainer(params, optimizer, dict(extra, loss_scaler=scaler()),
                            kvstore=None)
    if in_optimizer:
        mx_lbsgd.bind(trainer, window=False)
    opt = trainer.optimizer
    reports = train(trainer, params, 8, injections, opt)
    report = reports[at]
    # a window at the Trainer decides once per window: the report stays until the next one
    B = 1 if in_optimizer else extra.get('batch_scale', 1)
    decided = [max([d for d in range(s + 1) if (d + 1) % B == 0], default=None)
               for s in range(8)]
    assert [r is not None for r in reports] == [d == at for d in decided]
    assert all(r is report for r in reports if r is not None)
    step, micro_batch, found = expected
    assert isinstance(report, mx_lbsgd.OverflowReport)
    assert report.step == step
    assert report.micro_batch == micro_batch
    assert report.scale == INIT and report.scale_after == INIT / 2
    assert dict(report.parameters) == {n: k for n, (k, _) in found.items()}
    assert dict(report.counts) == {n: c for n, (_, c) in found.items()}
    assert list(report.parameters) == sorted(found, key=lambda n: (-found[n][1], n))
    assert (report.rank, report.num_workers, report.originated_here) == (None, 1, True)
    assert ('mean of the window of' in report.note) == (micro_batch is not None
                                                       and not in_optimizer)
    text = str(report)
    assert 'step %d skipped (loss scale 64 -> 32)' % step in text
    for name, (kind, count) in found.items():
        assert '%s %s (%d)' % (name, kind, count) in text
    assert list(opt.overflow_history) == [report]
    assert opt.overflow_tally == {n: 1 for n in found}
    with pytest.raises(AttributeError):
        report.step = 0                        # immutable
    with pytest.raises(TypeError):
        report.parameters['p0'] = 'inf'


def test_last_overflow_is_none_after_a_finite_step():
    params = make_params('float32')
    trainer = gluon.Trainer(params, 'lssgd', dict(loss_scaler=scaler()), kvstore=None)
    reports = train(trainer, params, 4, {1: [('p0', np.inf, 1)]}, trainer.optimizer)
    assert [r is None for r in reports] == [True, False, True, True]
    assert len(trainer.optimizer.overflow_history) == 1


def test_a_skipped_step_reads_its_report_only_when_looked_at(caplog):
    params = make_params('float32')
    trainer = gluon.Trainer(params, 'lssgd', dict(loss_scaler=scaler()), kvstore=None)
    opt = trainer.optimizer
    backward(params, 0, opt.loss_scaler.scale)
    inject(params['p1'].grad(), np.inf, 1)
    with caplog.at_level(logging.WARNING, logger='mx_lbsgd'):    # no INFO record to write
        with count_host_syncs(include_waitall=False) as read:
            trainer.step(1)
    assert read == [flag_read()] and opt.last_step_skipped    # the decision's one read
    with count_host_syncs(include_waitall=False) as read:
        first, again = opt.last_overflow, opt.last_overflow
    assert read == ['asnumpy'] and first is again            # one read, then kept
    assert dict(first.counts) == {'p1': 1}


def test_module_names_come_from_param_idx2name():
    del dist_worker.REPORTS[:]
    dist_worker.train(dict(api='module', optimizer='lssgd', steps=3, batch=16,
                           params=dict(loss_scaler=dict(init_scale=INIT)),
                           inject={'1': 0}, reports=True))
    reports = list(dist_worker.REPORTS)
    del dist_worker.REPORTS[:]
    assert reports[0] is None and reports[2] is None
    assert reports[1]['parameters'] == {'fc1_weight': 'inf'}
    assert reports[1]['counts'] == {'fc1_weight': 64 * 64}
    assert (reports[1]['step'], reports[1]['scale']) == (2, INIT)


def test_bare_updater_in_optimizer_window_names_and_micro_batch():
    opt = mx.optimizer.create('lbsgd', learning_rate=0.1, batch_scale=3, warmup_epochs=0,
                              loss_scaler=scaler(), param_idx2name={0: 'w', 1: 'b'})
    updater = mx.optimizer.get_updater(opt)
    weights = [nd.ones((3, 2)), nd.ones((2,))]
    seen = []
    for s in range(6):
        grads = [nd.ones((3, 2)) * INIT, nd.ones((2,)) * INIT]
        if s == 4:
            grads[1][1] = np.nan
        updater([0, 1], grads, weights)
        seen.append(opt.last_overflow)
    report = seen[4]
    assert [r is None for r in seen] == [True] * 4 + [False, True]
    assert (dict(report.parameters), dict(report.counts)) == ({'b': 'nan'}, {'b': 1})
    assert (report.step, report.micro_batch) == (5, 2)


HOOK_CASES = [
    pytest.param('sgd', dict(multi_precision=True), 'float16', False,
                 {2: [('p1', np.inf, 3)]}, 2, (3, None, {'p1': ('inf', 3)}), id='sgd-fp16'),
    pytest.param('sgd', {}, 'float32', True, {0: [('p2', np.nan, 2), ('p2', np.inf, 1)]},
                 0, (1, None, {'p2': ('inf+nan', 2)}), id='sgd-fp32-force-inf+nan'),
    pytest.param('lbsgd', dict(batch_scale=2, warmup_epochs=0), 'float32', True,
                 {3: [('p0', np.inf, 1)]}, 3, (4, 2, {'p0': ('inf', 1)}),
                 id='lbsgd-B2-fp32-mb2'),
]


@pytest.mark.parametrize('optimizer, extra, dtype, force, injections, at, expected',
                         HOOK_CASES)
def test_hook_report_fields(optimizer, extra, dtype, force, injections, at, expected):
    params = make_params(dtype)
    trainer = gluon.Trainer(params, optimizer, dict(extra, learning_rate=0.01), kvstore=None)
    hook = mx_lbsgd.LossScaling(trainer, scaler(), force=force)
    reports = train(trainer, params, 5, injections, hook, step=lambda t: hook.step(1))
    assert [s for s, r in enumerate(reports) if r is not None] == [at]
    report = reports[at]
    step, micro_batch, found = expected
    assert (report.step, report.micro_batch) == (step, micro_batch)
    assert (report.scale, report.scale_after) == (INIT, INIT / 2)
    assert dict(report.parameters) == {n: k for n, (k, _) in found.items()}
    assert dict(report.counts) == {n: c for n, (_, c) in found.items()}
    assert (report.rank, report.num_workers, report.originated_here) == (None, 1, True)
    assert list(hook.overflow_history) == [report]


@pytest.mark.parametrize('where', [pytest.param('optimizer', id='optimizer'),
                                   pytest.param('hook', id='hook')])
def test_history_is_bounded(where):
    params = make_params('float32')
    every = {s: [('p0', np.inf, 1)] for s in range(5)}
    scaler = lambda: DynamicLossScaler(init_scale=2.0 ** 20)     # noqa: E731
    if where == 'optimizer':
        trainer = gluon.Trainer(params, 'lssgd', dict(loss_scaler=scaler(),
                                                      overflow_history_size=3), kvstore=None)
        source, step = trainer.optimizer, None
    else:
        trainer = gluon.Trainer(params, 'sgd', {}, kvstore=None)
        source = mx_lbsgd.LossScaling(trainer, scaler(), force=True, history_size=3)
        step = lambda t: source.step(1)     # noqa: E731
    train(trainer, params, 5, every, source, step)
    assert [r.step for r in source.overflow_history] == [3, 4, 5]
    assert source.overflow_tally == {'p0': 5}


def test_log_records_are_rate_limited(caplog):
    params = make_params('float32')
    trainer = gluon.Trainer(params, 'lssgd', dict(
        loss_scaler=DynamicLossScaler(init_scale=2.0 ** 20, warn_backoffs=None),
        overflow_log_interval=10.0), kvstore=None)
    now = [0.0]
    trainer.optimizer._pieces.overflow._clock = lambda: now[0]
    times = [0.0, 1.0, 2.0, 9.0, 11.0, 12.0]
    with caplog.at_level(logging.INFO, logger='mx_lbsgd'):
        for s, t in enumerate(times):
            now[0] = t
            backward(params, s, trainer.optimizer.loss_scaler.scale)
            inject(params['p1'].grad(), np.inf, 1)
            trainer.step(1)
    records = [r for r in caplog.records if hasattr(r, 'overflow_report')]
    assert [r.overflow_report.step for r in records] == [1, 5]
    assert [r.suppressed for r in records] == [0, 3]
    assert '3 more skipped step(s) not logged' in records[1].getMessage()
    assert 'p1 inf (1)' in records[0].getMessage()


def test_early_warning_names_top_offender_before_min_scale(caplog):
    params = make_params('float32')
    sc = DynamicLossScaler(init_scale=2.0 ** 10, min_scale=1.0, warn_backoffs=4,
                           stuck_patience=2, on_stuck='raise')
    trainer = gluon.Trainer(params, 'lssgd', dict(loss_scaler=sc), kvstore=None)
    injections = {s: [('p2', np.inf, 1)] + ([('p0', np.nan, 1)] if s == 1 else [])
                  for s in range(20)}
    with caplog.at_level(logging.WARNING, logger='mx_lbsgd'), \
            pytest.warns(LossScaleFallingWarning) as caught:
        train(trainer, params, 4, injections, trainer.optimizer)
    falling = [w.message for w in caught if isinstance(w.message, LossScaleFallingWarning)]
    assert len(falling) == 1
    assert falling[0].offenders[0] == ('p2', 4)
    assert '4 backoffs without a growth' in str(falling[0]) and 'p2' in str(falling[0])
    assert sc.scale == 2.0 ** 6 > sc.min_scale
    # one channel: the warning (overflow_alert='warn', the default), no WARNING record
    # (tests/test_skip_report.py: overflow_alert='log')
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    # the stuck policy still acts once min_scale is reached
    with pytest.raises(LossScaleStuckError):
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', LossScaleFallingWarning)
            train(trainer, params, 12, injections, trainer.optimizer)


# -- the scaler's early-warning rule (pure) ---------------------------------------------

O, F = True, False
WARN_RULES = [
    pytest.param(dict(init_scale=2.0 ** 16, warn_backoffs=8), [O] * 10, [7], id='backoffs'),
    pytest.param(dict(init_scale=8.0, min_scale=1.0), [O] * 4, [1], id='one-backoff-from-min'),
    pytest.param(dict(init_scale=2.0 ** 16, warn_backoffs=2, growth_interval=2),
                 [O, O, F, F, O, O, O], [1, 5], id='re-armed-by-growth'),
    pytest.param(dict(init_scale=2.0 ** 16, warn_backoffs=3, growth_interval=2),
                 [O, O, F, F, O, O, F, F], [], id='growth-resets-the-count'),
    pytest.param(dict(init_scale=8.0, dynamic=False, warn_skip_fraction=0.3, warn_window=10),
                 [F] * 7 + [O, O, O, O] + [F] * 20 + [O, O, O], [9, 33],
                 id='skipped-fraction-static'),
    pytest.param(dict(init_scale=2.0 ** 16, warn_backoffs=None, warn_skip_fraction=None),
                 [O] * 16, [], id='off'),
]


@pytest.mark.parametrize('config, flags, fired_at', WARN_RULES)
def test_scaler_early_warning_rule(config, flags, fired_at):
    sc = DynamicLossScaler(**config)
    fired = []
    for i, flag in enumerate(flags):
        sc.update(flag)
        if sc.take_alert():
            fired.append(i)
            assert sc.scale > sc.min_scale
    assert fired == fired_at


def test_scaler_warning_config_travels_in_state_dict():
    a = DynamicLossScaler(warn_backoffs=3, warn_skip_fraction=0.5, warn_window=7)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert (b.warn_backoffs, b.warn_skip_fraction, b.warn_window) == (3, 0.5, 7)
    old = a.state_dict()
    for key in ('warn_backoffs', 'warn_skip_fraction', 'warn_window'):
        del old['config'][key]                 # a state_dict written before these existed
    b.load_state_dict(old)
    assert b.warn_backoffs == 8
    with pytest.raises(ValueError, match='warn_skip_fraction'):
        DynamicLossScaler(warn_skip_fraction=1.5)


def test_scaler_pickled_before_the_warning_existed_still_updates():
    fresh = DynamicLossScaler(init_scale=4.0)
    old = {k: v for k, v in fresh.__dict__.items() if k in (
        'init_scale', 'growth_factor', 'backoff_factor', 'growth_interval', 'hysteresis',
        'consecutive_hysteresis', 'min_scale', 'max_scale', 'dynamic', 'enabled',
        'stuck_patience', 'on_stuck', '_scale', 'num_good_steps', 'num_bad_steps',
        'total_skipped', 'total_steps', 'stuck_steps')}
    scaler = DynamicLossScaler.__new__(DynamicLossScaler)
    scaler.__setstate__(old)
    assert scaler.update(True) is False and scaler.scale == 2.0
    assert scaler.warn_backoffs == 8 and scaler.take_alert() is None


# -- cost on finite steps ---------------------------------------------------------------

def _counted_steps(optimizer, extra, steps, dtype='float32'):
    params = make_params(dtype)
    for name, shape in (('big', (256, 256)),):        # one per-tensor route too
        p = params.get(name, shape=shape, dtype=dtype)
        p.initialize(ctx=mx.cpu())
    trainer = gluon.Trainer(params, optimizer, dict(extra, momentum=0.9), kvstore=None)
    scale = getattr(trainer.optimizer, 'loss_scaler', None)
    launches, syncs = [], []
    for s in range(steps):
        backward(params, s, scale.scale if scale else 1.0)
        mx.nd.waitall()
        with count_kernel_launches() as calls, count_host_syncs(include_waitall=False) as read:
            trainer.step(1)
        launches.append(len(calls))
        syncs.append(read)
    grads = [_compat.legacy(p.grad()) for p in params.values()]
    with count_kernel_launches() as calls:
        _kernels.finite_flag(grads, trainer.optimizer.fused)
    return launches, syncs, len(calls), trainer.optimizer


# the loss-scaled optimizer against the same update without loss scaling
COST_CASES = [
    pytest.param('lssgd', {}, 1, 'float32', id='lssgd-B1-fp32'),
    pytest.param('lssgd', dict(multi_precision=True), 1, 'float16', id='lssgd-B1-fp16'),
    pytest.param('lbsgd', dict(batch_scale=4), 4, 'float32', id='lbsgd-B4-window'),
    pytest.param('lbsgd', dict(batch_scale=4, multi_precision=True), 4, 'float16',
                 id='lbsgd-B4-window-fp16'),
]


@pytest.mark.parametrize('scaled, extra, B, dtype', COST_CASES)
def test_finite_steps_cost_one_check_one_read_and_one_flag_per_micro_batch(
        scaled, extra, B, dtype):
    steps = 3 * B
    plain = dict(extra, warmup_epochs=0)
    got, syncs, check, opt = _counted_steps(
        scaled, dict(plain if scaled == 'lbsgd' else extra, loss_scaler=scaler()), steps,
        dtype)
    base, base_syncs, _, _ = _counted_steps('lbsgd', plain, steps, dtype)
    assert check >= 1
    # natively the decision's check runs on the host (no launch), and a window's
    # micro-batch flag is its accumulate call's output (no launch either)
    decision = 0 if flag_read() == 'host_all_finite' else check
    for s in range(B, steps):                      # after the states exist
        closes = (s + 1) % B == 0
        extra_launches = got[s] - base[s]
        if B == 1:
            assert extra_launches == decision, (s, got, base)     # the one decision check
        else:                                      # the micro-batch's flag (+ the decision)
            flag = 0 if _native.ops() is not None else check
            assert extra_launches == flag + (decision if closes else 0), (s, got, base)
        assert syncs[s] == ([flag_read()] if closes else []), s
        assert base_syncs[s] == []
    assert opt.last_overflow is None and not opt.overflow_history


# -- 2-worker jobs: both ranks skip, each says what it can know ---------------------------

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'dist_worker.py')
SCALED = dict(loss_scaler=dict(init_scale=2.0 ** 6, growth_interval=100))


def _job(cfg, tmp_path, kind):
    env = {'PYTHONPATH': os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(WORKER)), os.environ.get('PYTHONPATH')]))}
    if kind == 'dist_sync':
        out = io.StringIO()
        code = launch([sys.executable, WORKER, json.dumps(cfg), str(tmp_path)], 2, 1,
                      timeout=90, stream=out, env=env)
        log = out.getvalue()
    else:
        import subprocess
        pytest.importorskip('horovod.mxnet')
        run = os.path.join(os.path.dirname(sys.executable), 'horovodrun')
        proc = horovodrun([run, '--gloo', '-np', '2', '-H', 'localhost:2', sys.executable,
                           WORKER, json.dumps(cfg), str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=150, env=dict(os.environ, **env))
        code, log = proc.returncode, proc.stdout
    assert code == 0, log
    return [json.load(open(str(tmp_path / ('rank%d.reports.json' % r)))) for r in range(2)]


DIST_CASES = [
    # rank 1 writes inf into dense0_bias at loop step 1: micro-batch 2 of the first window
    pytest.param('dist_sync', dict(api='gluon', optimizer='lbsgd', steps=8, batch=16,
                                   params=dict(SCALED, batch_scale=4, warmup_epochs=0),
                                   kvstore='dist_sync', update_on_kvstore=False,
                                   inject={'1': 1}, reports=True),
                 3, 2, True, id='dist_sync-window-B4-mb2'),
    pytest.param('dist_sync', dict(api='gluon', optimizer='lssgd', steps=4, batch=16,
                                   params=SCALED, kvstore='dist_sync', update_on_kvstore=False,
                                   inject={'2': 1}, reports=True, check_local=True),
                 2, None, True, id='dist_sync-lssgd-check_local'),
    pytest.param('dist_sync', dict(api='gluon', optimizer='lssgd', steps=4, batch=16,
                                   params=SCALED, kvstore='dist_sync', update_on_kvstore=False,
                                   inject={'2': 1}, reports=True),
                 2, None, False, id='dist_sync-lssgd-origin-unknown'),
    pytest.param('horovod', dict(api='gluon', optimizer='sgd', steps=4, batch=16,
                                 params={}, kvstore='horovod', hook=dict(init_scale=2.0 ** 6),
                                 inject={'2': 1}, reports=True, check_local=True),
                 2, None, True, id='horovod-hook-check_local', marks=pytest.mark.horovod),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize('kind, cfg, at, micro_batch, knows_origin', DIST_CASES)
def test_two_workers_one_injects(tmp_path, kind, cfg, at, micro_batch, knows_origin):
    ranks = _job(cfg, tmp_path, kind)
    B = cfg['params'].get('batch_scale', 1)
    for rank, reports in enumerate(ranks):
        # both ranks skip; a window's report stays until the next window is decided
        assert [s for s, r in enumerate(reports) if r is not None] == list(range(at, at + B))
        report = reports[at]
        assert (report['rank'], report['num_workers']) == (rank, 2)
        (name, kind), = report['parameters'].items()
        assert name.endswith('_dense0_bias') and kind == 'inf'     # hybridsequential0_...
        assert report['counts'] == {name: 64}
        assert report['scale'] == 2.0 ** 6 and report['scale_after'] == 2.0 ** 5
        injector = rank == 1
        if knows_origin:
            assert report['originated_here'] is injector
            assert report['micro_batch'] == (micro_batch if injector else None)
            assert ("This worker's own" in report['note']) is injector
            assert ('another worker' in report['note']) is (not injector)
        else:
            assert report['originated_here'] is None and report['micro_batch'] is None
            assert 'not known' in report['note']
