"""The ``mx-lbsgd`` command: train, mlm, schedule, bench, study, launch.

    mx-lbsgd train [--optimizer lbsgd] [--dtype float16] [--out DIR] ...
    mx-lbsgd mlm [--steps 200] [--batch-scale 4] [--dtype float16] [--horovod] [--out DIR]
    mx-lbsgd schedule --warmup-steps 100 --batch-scale 8 [--plot FILE.png]
    mx-lbsgd bench [--loss-scale | --step | --window] [ARGS of the benchmark ...]
    mx-lbsgd study [--tiny] [--out DIR]
    mx-lbsgd launch -n 2 -- python train.py

``main(argv)`` returns the exit status: 0 on success, 2 for bad arguments (one line on
stderr, ``mx-lbsgd CMD: error: ...``, never a traceback).

``import mx_lbsgd_demo.cli`` needs only what ``mx_lbsgd`` needs (MXNet, NumPy):
scikit-learn, tqdm and matplotlib (the ``demo`` extra) are imported where used. ``train``,
``study`` and ``schedule --plot`` check for them after parsing their arguments and, when
missing, print one line naming the install command and exit 2.
"""
import argparse
import importlib
import sys

from .args import Parser, UsageError

__all__ = ['main']

_COMMANDS = (
    ('train', 'train an MLP on the 8x8 digits; write metrics, summary and plots'),
    ('mlm', 'BERT-style masked-LM pre-training with lblamb on synthetic tokens'),
    ('schedule', 'print (and plot) the warmup learning-rate multiplier of each strategy'),
    ('bench', 'optimizer step time against MXNet at every model shape (bench_shapes)'),
    ('study', 'accuracy vs batch size per method (mx_lbsgd_demo.study)'),
    ('launch', 'run a local dist_sync job (mx_lbsgd.launch)'),
)
#: ``mx-lbsgd bench`` flag -> the module of mx_lbsgd_bench whose main(argv, prog) it runs
#: (default: bench_shapes).
_BENCHMARKS = {'loss_scale': 'bench_loss_scale', 'step': 'bench_step', 'window': 'bench_window'}


def _cmd_train(argv):
    from . import train_command
    return train_command.main(argv)


def _cmd_mlm(argv):
    from . import mlm
    return mlm.main(argv)


def _cmd_schedule(argv):
    from . import schedule_command
    return schedule_command.main(argv)


def _cmd_bench(argv):
    p = Parser(prog='mx-lbsgd bench', description=(
        'Time the optimizer step against MXNet\'s own optimizers. By default runs '
        'mx_lbsgd_bench.bench_shapes, the benchmark the docs report: step time, host syncs '
        'and operator calls per step vs tensor count (4M parameters in N tensors), on '
        "ResNet-50 v1's 193 shapes, and of loss-scaled Trainer steps (several minutes on 2 "
        'cores; --quick: fewer rounds and steps, float32). Arguments it does not know go to '
        'the benchmark, e.g. --quick --only resnet --rounds 3 --json F --plot F.png; '
        "'mx-lbsgd bench --help-benchmark' (or 'mx-lbsgd bench --loss-scale "
        "--help-benchmark') shows the benchmark's own options."))
    which = p.add_mutually_exclusive_group()
    which.add_argument('--loss-scale', action='store_true',
                       help='run mx_lbsgd_bench.bench_loss_scale instead: the loss-scaled step '
                            "against contrib.amp's checks (it has --quick)")
    which.add_argument('--step', action='store_true',
                       help='run mx_lbsgd_bench.bench_step instead (superseded by the default: '
                            "ResNet-50's shapes only, fused=False/True only)")
    which.add_argument('--window', action='store_true',
                       help="run mx_lbsgd_bench.bench_window instead: lblamb's accumulation "
                            'window (batch_scale=4) against the GluonNLP-style loop')
    which.add_argument('--shapes', action='store_true', help=argparse.SUPPRESS)   # the default
    p.add_argument('--help-benchmark', action='store_true',
                   help="show the chosen benchmark's own options and exit")
    args, rest = p.parse_known_args(argv)
    if rest[:1] == ['--']:
        rest = rest[1:]
    flag = next((f for f in _BENCHMARKS if getattr(args, f)), None)
    name = _BENCHMARKS.get(flag, 'bench_shapes')
    prog = 'mx-lbsgd bench' + (' --' + flag.replace('_', '-') if flag else '')
    if args.help_benchmark:
        rest = ['--help']
    importlib.import_module('mx_lbsgd_bench.' + name).main(rest, prog=prog)
    return 0


def _cmd_study(argv):
    from . import study
    return study.main(argv, prog='mx-lbsgd study')


def _cmd_launch(argv):
    from mx_lbsgd import launch
    return launch.main(argv)


_HANDLERS = {'train': _cmd_train, 'mlm': _cmd_mlm, 'schedule': _cmd_schedule,
             'bench': _cmd_bench, 'study': _cmd_study, 'launch': _cmd_launch}


def _top_parser():
    from mx_lbsgd import __version__
    p = Parser(prog='mx-lbsgd', description=(
        'Large-batch SGD and dynamic loss scaling for MXNet 1.9.1: demos and tools.'),
        epilog='Commands:\n' + '\n'.join('  %-9s %s' % c for c in _COMMANDS)
        + "\n\nRun 'mx-lbsgd COMMAND --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--version', action='version', version='mx_lbsgd %s' % __version__)
    p.add_argument('command', choices=[c for c, _ in _COMMANDS], metavar='COMMAND',
                   help='one of: %s' % ', '.join(c for c, _ in _COMMANDS))
    return p


def _exit_status(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv=None):
    """Run ``mx-lbsgd`` with `argv` (default sys.argv[1:]); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0].startswith('-'):
            _top_parser().parse_args(argv)            # --help / --version / error
            return 2
        if argv[0] not in _HANDLERS:
            _top_parser().parse_args(argv[:1])        # one-line 'invalid choice' error
        return _HANDLERS[argv[0]](argv[1:])
    except UsageError as err:
        print(err, file=sys.stderr)
        return 2
    except SystemExit as exit_:
        return _exit_status(exit_.code)
    except KeyboardInterrupt:
        print('interrupted', file=sys.stderr)
        return 130


if __name__ == '__main__':
    sys.exit(main())
