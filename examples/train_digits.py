"""Train an MLP on scikit-learn's bundled 8x8 digits with mx_lbsgd's LBSGD (Gluon Trainer).

    python examples/train_digits.py [--strategy linear] [--batch-scale 4] [--epochs 10]

Micro-batches of --batch-size are accumulated --batch-scale times per update (an effective
batch of batch_size * batch_scale), with the learning rate warmed up to batch_scale * lr.
"""
import argparse
import time

import numpy as np
import mxnet as mx
from sklearn.datasets import load_digits

import mx_lbsgd


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--strategy', default='linear', choices=mx_lbsgd.WARMUP_STRATEGIES)
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--batch-scale', type=int, default=4)
    parser.add_argument('--epochs', type=int, default=10)
    parser.add_argument('--lr', type=float, default=None,
                        help='default: 0.02 (1.0 for lars, whose trust ratio scales it)')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()
    lr = args.lr if args.lr is not None else (1.0 if args.strategy == 'lars' else 0.02)

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.float32)
    order = np.random.RandomState(args.seed).permutation(len(x))
    test, train = order[:len(x) // 4], order[len(x) // 4:]

    mx.random.seed(args.seed)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(64, activation='relu'), mx.gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    steps_per_epoch = len(train) // args.batch_size
    trainer = mx.gluon.Trainer(net.collect_params(), 'lbsgd', dict(
        learning_rate=lr, momentum=0.9, wd=1e-4, warmup_strategy=args.strategy,
        batch_scale=args.batch_scale, warmup_epochs=1, updates_per_epoch=steps_per_epoch,
        lars_eta=0.001))
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(args.seed)
    print('LBSGD %s, micro-batch %d x batch_scale %d, lr %g' % (
        args.strategy, args.batch_size, args.batch_scale, lr))
    start = time.time()
    for epoch in range(args.epochs):
        perm = rng.permutation(train)
        total = 0.0
        for i in range(steps_per_epoch):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            xb, yb = mx.nd.array(x[idx]), mx.nd.array(y[idx])
            with mx.autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            trainer.step(len(idx))
            total += loss.mean().asscalar()
        pred = net(mx.nd.array(x[test])).argmax(axis=1).asnumpy()
        print('epoch %2d  loss %.4f  test accuracy %.4f' % (
            epoch + 1, total / steps_per_epoch, np.mean(pred == y[test])))
    print('done in %.1f s' % (time.time() - start))


if __name__ == '__main__':
    main()
