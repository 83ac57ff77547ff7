"""``mx-lbsgd mlm``: BERT-style masked-language-model pre-training on synthetic tokens with
``'lblamb'`` (mx_lbsgd.LAMB): accumulation (``batch_scale``), fp16 with fp32 master copies
and dynamic loss scaling, linear warmup then linear decay, LayerNorm and biases out of the
trust ratio and of weight decay, Horovod, and checkpoints that resume bit for bit.

Data (:class:`MarkovTokens`): an endless stream of sequences of a random sparse Markov
chain, so a masked token is predictable from its neighbours. Sequence ``j`` of micro-batch
``m`` depends only on (seed, m, j); with Horovod, rank r takes sequences
``r*B .. (r+1)*B - 1``, so 2 ranks of micro-batch B see what 1 process of 2B sees.

Units: ``--steps``, ``--warmup`` and ``--checkpoint-every`` count updates (windows of
``--batch-scale`` micro-batches); ``--stop-after`` counts micro-batches (an interruption,
possibly inside a window). Checkpoints are folders ``OUT/checkpoints/micro-batch-NNNNNNN``:
``model.params`` and ``progress.json`` (rank 0) and the Trainer's states (``trainer.states``
from rank 0 at a window boundary; inside a window every rank's own ``trainer.rankR.states``,
since the accumulators are each rank's partial sums). ``progress.json`` is written last: a
folder without it is incomplete. Every file is written to a temporary name and renamed.
``OUT/checkpoints/latest`` names the checkpoint written last, which ``--resume OUT`` takes
(not the highest number: a new run into the folder of a finished one writes lower numbers).
A run stopped by ``--stop-after`` writes ``summary.json`` with ``"finished": false``; a
finished checkpoint is not resumed (there is nothing left to train: exit 2, one line).

The states files are ``mx_lbsgd.checkpoint``'s (atomic, checksummed, loaded by a
restricted unpickler into the live optimizer: every device's states, the counters, the lr
scheduler and the loss scaler).
"""
import json
import os
import sys
import tempfile
import time

import numpy as np

from .args import Parser, UsageError, number, require_writable_dir

__all__ = ['MarkovTokens', 'main', 'train']

PROG = 'mx-lbsgd mlm'
MASK = 0                        # token 0 is [MASK]; the chain walks tokens 1 .. vocab-1
_LATEST = 'latest'              # OUT/checkpoints/latest: the checkpoint folder written last
_STREAMS = {'train': 1, 'eval': 2}
#: options (argparse dests) that must match when resuming; world_size: the ranks
_RESUME_KEYS = ('vocab', 'hidden', 'layers', 'heads', 'seq_len', 'batch_size', 'batch_scale',
                'dtype', 'lr', 'wd', 'warmup', 'steps', 'seed', 'growth_interval',
                'max_grad_norm', 'world_size')


class MarkovTokens:
    """Sequences of a random first-order Markov chain (each token has `successors` possible
    next tokens, Dirichlet(0.5) probabilities), masked BERT's way: `mask_fraction` of the
    positions (a fixed number per sequence) are predicted; 80% of them become [MASK], 10% a
    random token, 10% stay."""

    def __init__(self, vocab, seq_len, seed, successors=4, mask_fraction=0.15):
        rng = np.random.default_rng([seed, 0])
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.next_tokens = rng.integers(1, vocab, size=(vocab, successors))
        cum = np.cumsum(rng.dirichlet(np.full(successors, 0.5), size=vocab), axis=1)
        cum[:, -1] = 1.0
        self._cum = cum
        self.masked = max(1, int(round(mask_fraction * seq_len)))

    def batch(self, stream, index, first, count):
        """Sequences first .. first+count-1 of micro-batch `index` of `stream` ('train' or
        'eval'): (inputs (count, seq_len), positions (count, masked) into the flattened
        batch, labels (count, masked)), float32 numpy arrays."""
        T, P = self.seq_len, self.masked
        draws = [np.random.default_rng([self.seed, _STREAMS[stream], index, first + j])
                 for j in range(count)]
        start = np.array([r.integers(1, self.vocab) for r in draws])
        walk = np.stack([r.random(T) for r in draws])
        picks = np.stack([r.permutation(T)[:P] for r in draws])
        how = np.stack([r.random(P) for r in draws])
        noise = np.stack([r.integers(1, self.vocab, size=P) for r in draws])
        tokens = np.empty((count, T), dtype=np.int64)
        tokens[:, 0] = start
        for t in range(1, T):
            prev = tokens[:, t - 1]
            k = (self._cum[prev] < walk[:, t, None]).sum(axis=1)
            tokens[:, t] = self.next_tokens[prev, np.minimum(k, self.next_tokens.shape[1] - 1)]
        rows = np.arange(count)[:, None]
        labels = tokens[rows, picks]
        inputs = tokens.copy()
        inputs[rows, picks] = np.where(how < 0.8, MASK, np.where(how < 0.9, noise, labels))
        positions = rows * T + picks
        return inputs.astype(np.float32), positions.astype(np.float32), \
            labels.astype(np.float32)


# -- command line -------------------------------------------------------------------------
def _parser():
    p = Parser(prog=PROG, description=(
        'BERT-style masked-language-model pre-training of a small transformer encoder on '
        'synthetic Markov-chain tokens with lblamb (mx_lbsgd.LAMB): micro-batches '
        'accumulated --batch-scale at a time, float16 weights with fp32 master copies and '
        'dynamic loss scaling, global-norm clipping of each update\'s gradient (--max-grad-norm), '
        'linear warmup then linear decay to 0, LayerNorm and biases out '
        'of the trust ratio and of weight decay. Writes summary.json and checkpoints to --out.'
        ' Under horovodrun pass --horovod.'),
        epilog='--steps, --warmup and --checkpoint-every count updates (windows of '
               '--batch-scale micro-batches); --stop-after counts micro-batches.')
    p.add_argument('--steps', type=number(int, 1), default=200,
                   help='updates to train (the schedule ends at 0 there; default 200)')
    p.add_argument('--batch-size', type=number(int, 1), default=32,
                   help='micro-batch of one forward/backward, per worker (default 32)')
    p.add_argument('--batch-scale', type=number(int, 1), default=4,
                   help='micro-batches accumulated per update (default 4)')
    p.add_argument('--dtype', choices=('float16', 'float32'), default='float16')
    p.add_argument('--lr', type=number(float, 0, open_low=True), default=0.05,
                   help='peak learning rate (default 0.05)')
    p.add_argument('--wd', type=number(float, 0), default=0.01, help='default 0.01')
    p.add_argument('--warmup', type=number(int, 0), default=20,
                   help='warmup updates, < --steps (default 20)')
    p.add_argument('--max-grad-norm', type=number(float, 0), default=1.0, metavar='NORM',
                   help="clip each update's gradient (the window's mean, unscaled) to this "
                        'global L2 norm, as the BERT recipe does (default 1.0; 0: off)')
    p.add_argument('--growth-interval', type=number(int, 1), default=100,
                   help='finite updates before the loss scale doubles (default 100)')
    p.add_argument('--vocab', type=number(int, 3), default=128,
                   help='token ids, [MASK] included (default 128)')
    p.add_argument('--hidden', type=number(int, 1), default=64)
    p.add_argument('--layers', type=number(int, 1), default=2)
    p.add_argument('--heads', type=number(int, 1), default=2,
                   help='attention heads; must divide --hidden (default 2)')
    p.add_argument('--seq-len', type=number(int, 2), default=32)
    p.add_argument('--horovod', action='store_true',
                   help='run as one rank of a horovodrun job (hvd.DistributedTrainer)')
    p.add_argument('--shard-states', action='store_true',
                   help='with --horovod: mx_lbsgd.ShardedTrainer, each rank keeping the '
                        'optimizer state of the parameters it owns (checkpoints at window '
                        'boundaries, one consolidated file)')
    p.add_argument('--checkpoint-every', type=number(int, 0), default=0,
                   help='write a checkpoint every this many updates (0: only at the end)')
    p.add_argument('--stop-after', type=number(int, 1), default=None, metavar='MICRO_BATCHES',
                   help='stop (and checkpoint) after this many micro-batches of the '
                        'schedule, as an interruption would, e.g. inside a window')
    p.add_argument('--resume', metavar='PATH',
                   help='a checkpoint folder, or a run\'s --out folder: then the checkpoint '
                        'that run wrote last (OUT/checkpoints/latest); a finished run is '
                        'refused (nothing left to train)')
    p.add_argument('--seed', type=number(int, 0), default=0)
    p.add_argument('--out', default='runs/mlm', help='output folder (default runs/mlm)')
    p.add_argument('--quiet', action='store_true', help='print only the summary')
    return p


def _usage(message):
    return UsageError('%s: error: %s' % (PROG, message))


def _check(args):
    if args.shard_states and not args.horovod:
        raise _usage('argument --shard-states: needs --horovod (under horovodrun)')
    if args.shard_states and args.stop_after is not None and args.stop_after % args.batch_scale:
        raise _usage('argument --stop-after: with --shard-states a checkpoint must be at a '
                     'window boundary (a multiple of --batch-scale %d), got %d'
                     % (args.batch_scale, args.stop_after))
    if args.warmup >= args.steps:
        raise _usage('argument --warmup: must be < --steps (%d), got %d'
                     % (args.steps, args.warmup))
    if args.hidden % args.heads:
        raise _usage('argument --heads: must divide --hidden (%d), got %d'
                     % (args.hidden, args.heads))
    total = args.steps * args.batch_scale
    if args.stop_after is not None and args.stop_after > total:
        raise _usage('argument --stop-after: must be <= --steps x --batch-scale = %d '
                     'micro-batches, got %d' % (total, args.stop_after))
    if args.resume is not None:
        args.resume = _find_checkpoint(args.resume)
    require_writable_dir(PROG, args.out)


def _find_checkpoint(path):
    """The checkpoint folder `path` names: itself, or the one written last under it (or
    under its checkpoints/): the folder named by ``checkpoints/latest``, else (a folder of
    checkpoints without that file) the highest-numbered complete one."""
    if os.path.isfile(os.path.join(path, 'progress.json')):
        return path
    for folder in (os.path.join(path, 'checkpoints'), path):
        latest = os.path.join(folder, _LATEST)
        if os.path.isfile(latest):
            try:
                with open(latest) as f:
                    name = f.read().strip()
            except OSError as err:
                raise _usage('argument --resume: cannot read %s (%s)'
                             % (latest, err.strerror or err)) from None
            chosen = os.path.join(folder, name)
            if (os.sep in name or not name.startswith('micro-batch-')
                    or not os.path.isfile(os.path.join(chosen, 'progress.json'))):
                raise _usage('argument --resume: %s names %r, which is not a complete '
                             'checkpoint folder (give one with --resume %s)'
                             % (latest, name, os.path.join(folder, 'micro-batch-N')))
            return chosen
        if os.path.isdir(folder):
            done = sorted(d for d in os.listdir(folder) if d.startswith('micro-batch-')
                          and os.path.isfile(os.path.join(folder, d, 'progress.json')))
            if done:
                return os.path.join(folder, done[-1])
    raise _usage('argument --resume: no checkpoint in %s (expected a folder with '
                 'progress.json, or one holding micro-batch-* folders)' % path)


# -- distributed --------------------------------------------------------------------------
class _World:
    """Rank, size and the few collective calls the loop needs (a no-op in one process)."""

    def __init__(self, horovod):
        self.hvd = None
        self.rank, self.size = 0, 1
        if horovod:
            try:
                import horovod.mxnet as hvd
            except ImportError as err:
                raise _usage('argument --horovod: horovod with MXNet support is not '
                             'importable (%s): bash scripts/install_horovod.sh' % err) from None
            hvd.init()
            self.hvd, self.rank, self.size = hvd, hvd.rank(), hvd.size()

    def total(self, array):
        """The sum of `array` (an NDArray) over the ranks."""
        if self.hvd is None:
            return array
        return self.hvd.allreduce(array, op=self.hvd.Sum, name='mlm_metrics')

    def gather(self, array):
        """numpy (ranks, *shape): every rank's `array` (an NDArray), in rank order."""
        if self.hvd is None:
            return array.asnumpy()[None]
        every = self.hvd.allgather(array.expand_dims(0), name='mlm_gather')
        return every.asnumpy()

    def param_digests(self, net):
        """SHA-256 of the parameters' bytes, one per rank (rank order)."""
        import hashlib
        import mxnet as mx
        digest = hashlib.sha256()
        for _, param in sorted(net.collect_params().items()):
            digest.update(param.data().asnumpy().tobytes())
        if self.hvd is None:
            return [digest.hexdigest()]
        mine = np.frombuffer(digest.digest(), dtype=np.uint8).astype(np.int32)[None]
        every = self.hvd.allgather(mx.nd.array(mine, dtype='int32'), name='mlm_digest')
        return [bytes(row.astype(np.uint8).tolist()).hex() for row in every.asnumpy()]

    def barrier(self):
        if self.hvd is not None:
            import mxnet as mx
            self.hvd.allreduce(mx.nd.ones((1,)), name='mlm_barrier').wait_to_read()


# -- model and trainer --------------------------------------------------------------------
def _build(args, world, resume):
    """(net, trainer, scaler or None); `resume` loads the checkpoint folder's weights and
    trainer states."""
    import mxnet as mx
    import mx_lbsgd
    from .transformer import NO_DECAY_SUFFIXES, MaskedLM
    mx.random.seed(args.seed)
    net = MaskedLM(args.vocab, args.hidden, args.layers, args.heads, args.seq_len,
                   dtype=args.dtype)
    net.initialize(ctx=mx.cpu())
    if resume:
        params = os.path.join(resume, 'model.params')
        try:
            net.load_parameters(params, ctx=mx.cpu())
        except (mx.base.MXNetError, OSError, ValueError, AssertionError) as err:
            raise _usage('argument --resume: %s is not a readable parameter file of this '
                         'model (truncated or damaged?): %s' % (params, _first_line(err))) \
                from None
    for param in net.collect_params().values():
        if param.name.endswith(NO_DECAY_SUFFIXES):
            param.wd_mult = 0.0
    net.hybridize(static_alloc=True)
    scaler = (mx_lbsgd.DynamicLossScaler(growth_interval=args.growth_interval)
              if args.dtype == 'float16' else None)
    schedule = mx_lbsgd.WarmupScheduler(base_lr=args.lr, warmup_steps=args.warmup,
                                        strategy='linear', decay='poly', power=1,
                                        max_update=args.steps)
    opt = mx_lbsgd.LAMB(learning_rate=args.lr, wd=args.wd, trust_exclude=True,
                        batch_scale=args.batch_scale, multi_precision=True,
                        lr_scheduler=schedule, loss_scaler=scaler,
                        max_grad_norm=args.max_grad_norm or None)
    if world.hvd is not None:
        # (hvd.broadcast_parameters: Horovod 0.28.1's MXNet broadcast reads freed memory)
        mx_lbsgd.distributed.broadcast_parameters(net.collect_params(), root_rank=0)
        trainer = (mx_lbsgd.ShardedTrainer(net.collect_params(), opt) if args.shard_states
                   else world.hvd.DistributedTrainer(net.collect_params(), opt))
    else:
        trainer = mx.gluon.Trainer(net.collect_params(), opt, update_on_kvstore=False)
    if resume:
        shared = os.path.join(resume, 'trainer.states')
        states = (shared if os.path.exists(shared) else
                  os.path.join(resume, 'trainer.rank%d.states' % world.rank))
        try:
            if args.shard_states:
                trainer.load_states(states)        # keeps this rank's shard
            else:
                mx_lbsgd.checkpoint.load_states(trainer, states)
        except (OSError, ValueError) as err:
            raise _usage('argument --resume: cannot load the trainer states %s: %s'
                         % (states, _first_line(err))) from None
    return net, trainer, scaler


def _first_line(err):
    """The first non-empty line of an exception's message (MXNet's span many lines)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


# -- checkpoints --------------------------------------------------------------------------
def _save(args, world, net, trainer, micro_batches, state):
    """Write OUT/checkpoints/micro-batch-N (see the module docstring); returns its path."""
    folder = os.path.join(args.out, 'checkpoints', 'micro-batch-%07d' % micro_batches)
    os.makedirs(folder, exist_ok=True)
    import mx_lbsgd
    mid_window = trainer.optimizer.window_position != 0
    if isinstance(trainer, mx_lbsgd.ShardedTrainer):
        trainer.save_states(os.path.join(folder, 'trainer.states'))     # every rank
    elif mid_window:
        mx_lbsgd.checkpoint.save_states(
            trainer, os.path.join(folder, 'trainer.rank%d.states' % world.rank))
    elif world.rank == 0:
        mx_lbsgd.checkpoint.save_states(trainer, os.path.join(folder, 'trainer.states'))
    world.barrier()                           # every rank's states are on disk
    if world.rank == 0:
        _atomic(os.path.join(folder, 'model.params'), net.save_parameters)
        meta = dict(state, micro_batches=micro_batches, mid_window=mid_window,
                    config=_resume_config(args, world))
        _atomic(os.path.join(folder, 'progress.json'),
                lambda tmp: _write_json(tmp, meta))
        _atomic(os.path.join(os.path.dirname(folder), _LATEST),
                lambda tmp: _write_text(tmp, os.path.basename(folder) + '\n'))
    world.barrier()
    return folder


def _atomic(path, write):
    fd, tmp = tempfile.mkstemp(prefix='.' + os.path.basename(path) + '.',
                               dir=os.path.dirname(path))
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_text(path, text):
    with open(path, 'w') as f:
        f.write(text)


def _write_json(path, obj):
    with open(path, 'w') as f:
        json.dump(obj, f, indent=1)


def _resume_config(args, world):
    config = {k: getattr(args, k) for k in _RESUME_KEYS if k != 'world_size'}
    config['world_size'] = world.size
    return config


def _load_progress(args, world):
    path = os.path.join(args.resume, 'progress.json')
    try:
        with open(path) as f:
            meta = json.load(f)
        saved = meta['config']
        done = int(meta['micro_batches'])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise _usage('argument --resume: %s is not a readable progress file (truncated or '
                     'damaged?): %s' % (path, _first_line(err))) from None
    now = _resume_config(args, world)
    for key in _RESUME_KEYS:
        if saved.get(key) != now[key]:
            flag = ('horovodrun -np' if key == 'world_size'
                    else '--' + key.replace('_', '-'))
            raise _usage('argument --resume: the checkpoint was written with %s %s, this run '
                         'has %s (resume with the same settings)'
                         % (flag, saved.get(key), now[key]))
    total = args.steps * args.batch_scale
    if done >= total:
        raise _usage('argument --resume: %s is the end of a finished run (%d of %d '
                     'micro-batches, all %d updates): nothing is left to resume (a new run '
                     'trains again)' % (args.resume, done, total, args.steps))
    if args.stop_after is not None and args.stop_after <= done:
        raise _usage('argument --stop-after: must be > the %d micro-batches of the '
                     'checkpoint, got %d' % (done, args.stop_after))
    return meta


# -- training -----------------------------------------------------------------------------
def _evaluate(net, data, count=256, chunk=64):
    """Masked-token loss and accuracy on the fixed eval stream (the same on every rank)."""
    import mxnet as mx
    loss_sum = correct = tokens = 0.0
    for i in range(count // chunk):
        x, pos, y = data.batch('eval', i, 0, chunk)
        logits = net(mx.nd.array(x), mx.nd.array(pos))
        y = mx.nd.array(y)
        loss_sum += float(_token_losses(logits, y).sum().asscalar())
        correct += float((logits.argmax(axis=-1) == y).sum().asscalar())
        tokens += y.size
    return dict(loss=loss_sum / tokens, masked_acc=correct / tokens)


def _token_losses(logits, labels):
    import mxnet as mx
    return -mx.nd.pick(mx.nd.log_softmax(logits, axis=-1), labels, axis=-1)


def train(args, log=print):
    """Run the parsed, checked `args`; returns the summary dict (rank 0's is written)."""
    import mxnet as mx
    world = _World(args.horovod)
    meta = _load_progress(args, world) if args.resume else {}
    data = MarkovTokens(args.vocab, args.seq_len, args.seed)
    net, trainer, scaler = _build(args, world, args.resume)
    opt, B = trainer.optimizer, args.batch_scale
    done = meta.get('micro_batches', 0)
    if args.resume and world.rank == 0 and not args.quiet:
        log('resuming from %s: micro-batch %d of %d (update %d of %d)'
            % (args.resume, done, args.steps * B, done // B, args.steps))
    history = meta.get('history', [])
    eval_before = meta.get('eval_before') or _evaluate(net, data)
    stop = args.stop_after or args.steps * B
    elapsed = meta.get('wall_time_s', 0.0)
    start = time.perf_counter()
    # this rank's loss sum, correct, masked tokens of the open window (a checkpoint may
    # split a window: then each rank's partial sums are in the checkpoint)
    stats = mx.nd.array(meta.get('window_stats', [[0.0] * 3] * world.size)[world.rank])
    for m in range(done, stop):
        x, pos, y = data.batch('train', m, world.rank * args.batch_size, args.batch_size)
        y = mx.nd.array(y)
        scale = scaler.scale if scaler is not None else 1.0
        with mx.autograd.record():
            logits = net(mx.nd.array(x), mx.nd.array(pos))
            losses = _token_losses(logits, y).mean(axis=-1)         # per sequence
            scaled = losses * scale if scale != 1.0 else losses
        scaled.backward()
        trainer.step(args.batch_size)       # horovod's trainer averages over the ranks
        stats += mx.nd.concat(losses.sum() * y.shape[1], (logits.argmax(axis=-1) == y).sum(),
                              mx.nd.array([y.size]), dim=0)
        if (m + 1) % B == 0:
            history.append(_window_row(world, trainer, scaler, (m + 1) // B, stats))
            stats[:] = 0
            if world.rank == 0 and not args.quiet and _report(len(history), args.steps):
                log(_row_text(history[-1], args.steps))
        update = (m + 1) // B
        if ((m + 1) % B == 0 and args.checkpoint_every and update % args.checkpoint_every == 0
                and m + 1 < stop):
            _save(args, world, net, trainer, m + 1, dict(
                history=history, eval_before=eval_before,
                wall_time_s=elapsed + time.perf_counter() - start))
    wall = elapsed + time.perf_counter() - start
    folder = _save(args, world, net, trainer, stop, dict(
        history=history, eval_before=eval_before, window_stats=world.gather(stats).tolist(),
        wall_time_s=wall))
    summary = _summary(args, world, history, eval_before, _evaluate(net, data), opt, scaler,
                       stop, wall, folder)
    summary['finished'] = stop == args.steps * B
    # this rank's optimizer state and window accumulators, in bytes (sharded runs)
    summary['optimizer_state_bytes'] = (trainer.optimizer_state_bytes() if args.shard_states
                                        else None)
    summary['accumulator_bytes'] = (trainer.accumulator_bytes() if args.shard_states
                                    else None)
    summary['param_sha256_per_rank'] = world.param_digests(net)
    if world.rank == 0:
        _write_json(os.path.join(args.out, 'summary.json'), summary)
    return summary


def _window_row(world, trainer, scaler, update, stats):
    loss_sum, correct, tokens = world.total(stats).asnumpy().tolist()
    return dict(update=update, loss=loss_sum / tokens, masked_acc=correct / tokens,
                lr=trainer.learning_rate,
                loss_scale=scaler.scale if scaler is not None else 1.0,
                skipped=bool(trainer.optimizer.last_step_skipped),
                grad_norm=_finite_or_none(trainer.optimizer.last_grad_norm))


def _finite_or_none(norm):
    """A clipping norm for JSON: a float, or None without clipping or when not finite."""
    value = None if norm is None else float(norm.asscalar())
    return value if value is not None and np.isfinite(value) else None


def _report(update, steps):
    return update == 1 or update == steps or update % max(1, steps // 10) == 0


def _row_text(row, steps):
    return ('update %*d/%d  loss %.3f  masked acc %.3f  lr %.5f  loss scale %g%s'
            % (len(str(steps)), row['update'], steps, row['loss'], row['masked_acc'],
               row['lr'], row['loss_scale'], '  (skipped)' if row['skipped'] else ''))


def _mean(rows, key):
    return float(np.mean([r[key] for r in rows])) if rows else float('nan')


def _summary(args, world, history, before, after, opt, scaler, micro_batches, wall, folder):
    window = max(1, min(10, len(history) // 4))
    return dict(
        command='mlm', optimizer='lblamb', dtype=args.dtype, rank=world.rank,
        shard_states=bool(args.shard_states),
        world_size=world.size,
        batch_size=args.batch_size, batch_scale=args.batch_scale,
        effective_batch_size=args.batch_size * args.batch_scale * world.size,
        steps=args.steps, micro_batches=micro_batches, updates=len(history),
        applied_updates=opt.applied_updates,
        skipped_steps=scaler.total_skipped if scaler is not None else 0,
        final_loss_scale=scaler.scale if scaler is not None else 1.0,
        max_grad_norm=args.max_grad_norm or None,
        clipped_updates=sum(1 for r in history if r.get('grad_norm') is not None
                            and args.max_grad_norm and r['grad_norm'] > args.max_grad_norm),
        first_loss=_mean(history[:window], 'loss'), last_loss=_mean(history[-window:], 'loss'),
        first_masked_acc=_mean(history[:window], 'masked_acc'),
        last_masked_acc=_mean(history[-window:], 'masked_acc'),
        eval_before=before, eval_after=after, final_masked_acc=after['masked_acc'],
        chance_acc=1.0 / (args.vocab - 1), wall_time_s=wall, checkpoint=folder,
        loss_curve=history, args={k: v for k, v in vars(args).items()})


def main(argv=None):
    """``mx-lbsgd mlm``: returns the exit status (2 for bad arguments, one line)."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    _check(args)
    summary = train(args)
    if summary['rank'] == 0 and not summary['finished']:
        print('mlm: stopped after micro-batch %d of %d (update %d of %d) as --stop-after '
              'asked; checkpoint %s; wrote %s (marked "finished": false); continue with: '
              'mx-lbsgd mlm ... --out %s --resume %s'
              % (summary['micro_batches'], args.steps * args.batch_scale,
                 summary['updates'], args.steps, summary['checkpoint'],
                 os.path.join(args.out, 'summary.json'), args.out, args.out))
    elif summary['rank'] == 0:
        print('mlm: %d updates (%d skipped), loss %.3f -> %.3f (first/last %d updates), eval '
              'masked acc %.3f -> %.3f (chance %.4f), final loss scale %g, %.1f s; wrote %s'
              % (summary['updates'], summary['skipped_steps'], summary['first_loss'],
                 summary['last_loss'], max(1, min(10, summary['updates'] // 4)),
                 summary['eval_before']['masked_acc'], summary['final_masked_acc'],
                 summary['chance_acc'], summary['final_loss_scale'], summary['wall_time_s'],
                 os.path.join(args.out, 'summary.json')))
    return 0


if __name__ == '__main__':
    sys.exit(main())
