"""A Horovod worker that ends with Horovod work still queued in MXNet's engine, for
tests/test_horovod_exit.py and benchmarks/soak_horovod.py.

    horovodrun --gloo -np 2 -H localhost:2 python tests/hvd_exit_worker.py MODE [--unprotected]

'queued': 'lblamb' under ``hvd.DistributedTrainer``, 6 steps of a 6-layer MLP, then 96 more
``hvd.allreduce_`` calls (each followed by a dependent op) and the end of the script, with
nothing waited for. 'raise': the same training, and rank 1 raises at step 3 right after its
``trainer.step`` pushed that step's collectives (plus a few more ``allreduce_`` calls).
'stuck': 'queued', then rank 1 pushes an allreduce rank 0 never runs and rank 0 sleeps
60 s before its end (rank 1's exit drain cannot finish until then).
`--unprotected` removes the package's exit drain first (to show what it prevents).
The initial weights go out with `mx_lbsgd.distributed.broadcast_parameters`;
`--hvd-broadcast` uses ``hvd.broadcast_parameters`` instead (Horovod 0.28.1's MXNet
broadcast, which reads a freed name on the engine thread: to measure that defect).
Prints ``steps done`` once the loop ends on a rank.
"""
import argparse
import atexit
import time

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon

import horovod.mxnet as hvd
import mx_lbsgd
from mx_lbsgd.distributed import horovod_exit as _horovod_exit

RAISE_RANK, RAISE_STEP, STEPS, EXTRA, STUCK_SECONDS = 1, 3, 6, 96, 60


def main():
    p = argparse.ArgumentParser()
    p.add_argument('mode', choices=['queued', 'raise', 'stuck'])
    p.add_argument('--unprotected', action='store_true')
    p.add_argument('--hvd-broadcast', action='store_true')
    args = p.parse_args()
    hvd.init()
    mx.random.seed(hvd.rank())
    net = gluon.nn.HybridSequential()
    for _ in range(5):
        net.add(gluon.nn.Dense(64, activation='relu'))
    net.add(gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 32)))
    params = net.collect_params()
    if args.hvd_broadcast:
        hvd.broadcast_parameters(params, root_rank=0)
    else:
        mx_lbsgd.distributed.broadcast_parameters(params, root_rank=0)
    trainer = hvd.DistributedTrainer(params, 'lblamb',
                                     dict(learning_rate=0.01, batch_scale=2))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(hvd.rank())
    for step in range(STEPS):
        x = mx.nd.array(rng.uniform(-1, 1, (16, 32)))
        y = mx.nd.array(rng.randint(0, 10, 16))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(16)                  # pushes this step's allreduces, waits for none
        if args.mode == 'raise' and step == RAISE_STEP and hvd.rank() == RAISE_RANK:
            for i in range(8):
                hvd.allreduce_(mx.nd.ones((256,)) * i, name='inflight_%d' % i)
            raise RuntimeError('worker %d fails at step %d with collectives in flight'
                               % (hvd.rank(), step))
    if args.unprotected:
        atexit.unregister(_horovod_exit.drain_at_exit)
    out = []
    for i in range(EXTRA):
        t = mx.nd.ones((1024,)) * (i + hvd.rank())
        hvd.allreduce_(t, name='tail_%d' % i)
        out.append(t * 2 + 1)             # depends on the collective's result
    print('steps done on rank %d (mx_lbsgd %s)' % (hvd.rank(), mx_lbsgd.__version__),
          flush=True)
    if args.mode == 'stuck':
        if hvd.rank() == 1:
            hvd.allreduce_(mx.nd.ones((8,)), name='only_rank_1')
        else:
            time.sleep(STUCK_SECONDS)


if __name__ == '__main__':
    main()
