"""``mx-lbsgd schedule``: print (and plot) the warmup learning-rate multiplier of each
strategy, optionally beside MXNet 1.9.1's own LBSGD's, measured through its update()."""
import os

from mx_lbsgd import schedules

from .args import Parser, UsageError, number, require_demo, require_plot_file

__all__ = ['SHAPES', 'mxnet_multiplier', 'schedule_table', 'main']

SHAPES = tuple(schedules.WARMUP_SHAPES)     # the strategies that are a schedule


def _parser():
    p = Parser(prog='mx-lbsgd schedule', description=(
        "Print the learning-rate multiplier of LBSGD's warmup strategies "
        '(mx_lbsgd.schedules.warmup_multiplier): it rises from 1 to --batch-scale over '
        '--warmup-steps micro-batches and stays there. The learning rate is lr times it. '
        "('lars' has no schedule: its multiplier is a per-layer trust ratio.)"))
    p.add_argument('--warmup-steps', type=number(int, 0), default=100,
                   help='warmup length W in micro-batches (warmup_epochs * '
                        'updates_per_epoch; default %(default)s)')
    p.add_argument('--batch-scale', type=number(float, 1), default=8.0,
                   help='the final multiplier B (default %(default)g)')
    p.add_argument('--steps', type=number(int, 0),
                   help='last step shown (default: 1.25 * warmup steps)')
    p.add_argument('--every', type=number(int, 1),
                   help='print every Kth step (default: about 20 rows)')
    p.add_argument('--strategies', nargs='+', choices=SHAPES, default=list(SHAPES),
                   metavar='S', help='subset of %s (default: all)' % ', '.join(SHAPES))
    p.add_argument('--mxnet', action='store_true',
                   help="add columns with MXNet 1.9.1's own LBSGD multiplier, measured "
                        'through its update() (needs an integral --batch-scale)')
    p.add_argument('--plot', metavar='FILE.png', help='also plot the curves into FILE.png')
    return p


def mxnet_multiplier(step, warmup_steps, batch_scale, strategy):
    """MXNet 1.9.1's LBSGD learning-rate multiplier at micro-batch `step`, measured through
    its public update() on a one-element float64 weight.

    MXNet's LBSGD applies an update when its micro-batch count is a multiple of
    batch_scale (an integer here), with the multiplier of that count. So: count
    warmup_steps * B micro-batches of warmup (updates_per_epoch = B), start B micro-batches
    before step * B (begin_epoch = step - 1), feed B gradients of 1 with lr 1, momentum 0,
    wd 0: the weight moves by -multiplier * (B * 1) / B. NaN at step 0: MXNet's count
    starts at 1, so it never uses a multiplier there. Exact to float32 (the kernel's lr)."""
    import mxnet as mx
    from mx_lbsgd import MXNET_LBSGD
    if step < 1:
        return float('nan')
    scale = int(batch_scale)
    opt = MXNET_LBSGD(learning_rate=1.0, momentum=0.0, wd=0.0, warmup_strategy=strategy,
                      warmup_epochs=warmup_steps, updates_per_epoch=scale,
                      begin_epoch=step - 1, batch_scale=scale)
    weight = mx.nd.zeros((1,), dtype='float64')
    grad = mx.nd.ones((1,), dtype='float64')
    state = opt.create_state(0, weight)
    for _ in range(scale):
        opt.update(0, weight, grad, state)
    return -float(weight.asscalar())


def schedule_table(warmup_steps, batch_scale, steps, every, strategies=SHAPES, mxnet=False):
    """(header, rows): rows of [step, multiplier per strategy (, MXNet's per strategy)]."""
    header = ['step'] + list(strategies) + ['mxnet:' + s for s in strategies if mxnet]
    rows = []
    for n in range(0, steps + 1, every):
        row = [n] + [schedules.warmup_multiplier(n, warmup_steps, batch_scale, s)
                     for s in strategies]
        if mxnet:
            row += [mxnet_multiplier(n, warmup_steps, batch_scale, s) for s in strategies]
        rows.append(row)
    return header, rows


def main(argv):
    """Run ``mx-lbsgd schedule`` with `argv`; returns the exit status (UsageError and
    SystemExit as the command's main turns them into one)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.mxnet and args.batch_scale != int(args.batch_scale):
        raise UsageError('%s: error: argument --mxnet: needs an integral --batch-scale '
                         "(MXNet's LBSGD updates when its micro-batch count is a multiple "
                         'of batch_scale), got %g' % (parser.prog, args.batch_scale))
    if args.plot:
        require_demo(parser.prog, ('matplotlib',), what='--plot')
        require_plot_file(parser.prog, '--plot', args.plot)
    steps = args.steps if args.steps is not None else max(1, (args.warmup_steps * 5) // 4)
    every = args.every or max(1, steps // 20)
    header, rows = schedule_table(args.warmup_steps, args.batch_scale, steps, every,
                                  args.strategies, args.mxnet)
    print('warmup multiplier: W = %d warmup steps, B = %g' % (args.warmup_steps,
                                                               args.batch_scale))
    widths = [max(10, len(h)) for h in header]
    print(' '.join('%*s' % (w, h) for w, h in zip(widths, header)))
    for row in rows:
        print('%*d ' % (widths[0], row[0])
              + ' '.join('%*.6f' % (w, v) for w, v in zip(widths[1:], row[1:])))
    if args.plot:
        from .plots import plot_schedule
        _, every_step = schedule_table(args.warmup_steps, args.batch_scale, steps, 1,
                                       args.strategies, args.mxnet)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
            plot_schedule(header, every_step, args.warmup_steps, args.batch_scale, args.plot)
        except OSError as err:     # after the check: the table above has the numbers
            raise UsageError('%s: error: argument --plot: could not write %s (%s); the '
                             'table above has the values' % (parser.prog, args.plot,
                                                             err.strerror or err)) from None
        print('wrote %s' % args.plot)
    return 0
