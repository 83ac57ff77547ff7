"""The loss-scaling core's step gate, table-driven with fake gradients (no kernels).

Each call is (device, dtype group, indices); a gradient is finite unless listed in `bad`.
"""
import warnings

import pytest

from mx_lbsgd import DynamicLossScaler
from mx_lbsgd.loss_scaling import StepGate as _StepGate, decide

pytestmark = [pytest.mark.unit, pytest.mark.fallback, pytest.mark.pipeline]


class _Handle:
    def __init__(self, value):
        self.value = value


class FakeGrad:
    def __init__(self, key, finite=True):
        self.key, self.finite = key, finite
        self.handle = _Handle(hash(key))


def check_counting(log):
    def check(grads, fused):
        log.append(sorted(g.key for g in grads))
        return all(g.finite for g in grads)
    return check


def run(steps, created_first=True, fresh=False):
    """steps: list of lists of calls (ctx, indices, bad indices). Returns, per step, the
    (ctx, indices, applied) runs in the order released, and the finite-check log."""
    log = []
    gate = _StepGate(check=check_counting(log))
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=100)
    out = []
    for s, calls in enumerate(steps):
        if created_first and s == 0:
            for ctx, indices, _ in calls:
                for i in indices:
                    gate.created((ctx, i))
        grads_of = {(ctx, i): FakeGrad((s, ctx, i), i not in bad)
                    for ctx, indices, bad in calls for i in indices}
        if fresh:
            gate.new_step(list(grads_of.values()))
        runs = []
        for ctx, indices, _ in calls:
            runs += [(c[0], tuple(c[1]), a) for c, a in gate.submit(
                [(ctx, i) for i in indices], [grads_of[(ctx, i)] for i in indices],
                (ctx, indices), scaler, scaler.scale)]
        out.append(runs)
    return out, log, scaler


CASES = [
    # Module, one device, fp16 group then fp32 group: the first call waits for the second
    pytest.param([[('c0', [0, 1], []), ('c0', [2], [])]] * 2, False,
                 [[('c0', (0, 1), True), ('c0', (2,), True)]] * 2, [3, 3], id='dtype-groups'),
    pytest.param([[('c0', [0, 1], []), ('c0', [2], [2])]], False,
                 [[('c0', (0, 1), False), ('c0', (2,), False)]], [3], id='overflow-in-second'),
    # Gluon: the step's fresh gradients are known, nothing is held back, one check
    pytest.param([[('c0', [0, 1], []), ('c1', [0, 1], [1])]], True,
                 [[('c0', (0, 1), False), ('c1', (0, 1), False)]], [4], id='gluon-two-devices'),
    pytest.param([[('c0', [0], []), ('c1', [0], [])]] * 3, True,
                 [[('c0', (0,), True), ('c1', (0,), True)]] * 3, [2, 2, 2],
                 id='gluon-steps'),
]


@pytest.mark.parametrize('steps, fresh, expected, checks_per_step', CASES)
def test_one_decision_per_step(steps, fresh, expected, checks_per_step):
    out, log, scaler = run(steps, fresh=fresh)
    assert out == expected
    assert scaler.total_steps == len(steps)
    assert len(log) == len(steps)                    # one finite check per step
    assert [len(grads) for grads in log] == checks_per_step


def test_first_step_waits_for_every_created_state():
    """Module's first step: the Updater creates the states of a whole call before it updates
    any, so the gate knows the fp32 group is still to come."""
    out, log, _ = run([[('c0', [0, 1], []), ('c0', [2], [])]], created_first=True)
    assert out == [[('c0', (0, 1), True), ('c0', (2,), True)]]
    assert log == [[(0, 'c0', 0), (0, 'c0', 1), (0, 'c0', 2)]]


def test_missing_parameter_runs_late_with_a_warning():
    steps = [[('c0', [0], []), ('c0', [1], [])],      # step 0: both groups
             [('c0', [0], [])],                      # step 1: group [1] missing
             [('c0', [0], []), ('c0', [1], [])]]
    with pytest.warns(RuntimeWarning, match='fewer parameters'):
        out, _, scaler = run(steps)
    assert out[1] == []                              # held back, waiting for [1]
    assert out[2][0] == ('c0', (0,), True)           # released at the next step's start
    assert scaler.total_steps == 3


@pytest.mark.parametrize('devices', [['c2'], ['c2', 'c3']], ids=['one-device', 'two-devices'])
def test_an_optimizer_moved_to_other_devices_decides_each_step_in_time(devices):
    """After two steps on c0 and c1, the Updater's calls come from other devices (the
    optimizer moved on to a Module bound elsewhere): the first of them begins a step as the
    first round does, so no call waits for keys that will not come, and every later step is
    decided once, over all its gradients."""
    old = [('c0', [0, 1], []), ('c1', [0, 1], [])]
    new = [(d, [0, 1], []) for d in devices]
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        out, log, scaler = run([old, old, new, new, new])
    assert [len(runs) for runs in out] == [2, 2, len(devices), len(devices), len(devices)]
    assert all(applied for runs in out for _, _, applied in runs)
    assert [len(grads) for grads in log] == [4, 4] + [2] * len(devices) + [2 * len(devices)] * 2
    assert scaler.total_steps == 5


def test_late_gradient_is_checked_on_its_own():
    """A second device whose keys the first step did not announce (Module, first step)
    arrives after the decision: checked alone, its overflow skips only its group."""
    log = []
    gate = _StepGate(check=check_counting(log))
    scaler = DynamicLossScaler(init_scale=8.0)
    gate.created(('c0', 0))
    assert gate.submit([('c0', 0)], [FakeGrad('a')], 'call0', scaler, 8.0) == [('call0', True)]
    with pytest.warns(RuntimeWarning, match='only partly skipped'):
        runs = gate.submit([('c1', 0)], [FakeGrad('b', finite=False)], 'call1', scaler, 8.0)
    assert runs == [('call1', False)]
    assert log == [['a'], ['b']]
    assert scaler.total_steps == 1 and scaler.total_skipped == 0


def test_late_gradient_after_gluon_decision_is_not_rechecked():
    log = []
    gate = _StepGate(check=check_counting(log))
    scaler = DynamicLossScaler()
    fresh = [FakeGrad('a'), FakeGrad('b')]
    gate.new_step(fresh)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert gate.submit([('c0', 0)], fresh[:1], 'x', scaler, 1.0) == [('x', True)]
        assert gate.submit([('c1', 0)], fresh[1:], 'y', scaler, 1.0) == [('y', True)]
    assert log == [['a', 'b']]


def test_gate_keeps_the_scale_of_the_decided_step():
    gate = _StepGate(check=lambda grads, fused: True)
    scaler = DynamicLossScaler(init_scale=4.0, growth_interval=1)
    gate.new_step([FakeGrad('a')])
    gate.submit([('c0', 0)], [FakeGrad('a')], 'x', scaler, scaler.scale)
    assert scaler.scale == 8.0 and gate.loss_scale == 4.0     # grew after the decision


@pytest.mark.parametrize('enabled, finite, applied, steps', [
    pytest.param(True, True, True, 1, id='finite'),
    pytest.param(True, False, False, 1, id='overflow'),
    pytest.param(False, False, True, 0, id='disabled'),
])
def test_decide(enabled, finite, applied, steps):
    scaler = DynamicLossScaler(enabled=enabled)
    assert decide(scaler, [], None, check=lambda g, f: finite) is applied
    assert scaler.total_steps == steps
