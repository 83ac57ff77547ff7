"""tests/noise_worker.py's problem on Horovod's DistributedTrainer with a
``gradient_predivide_factor`` (the allreduce sums the gradients divided by it, and the
Trainer's scale carries factor / size: the reduced gradient is neither the sum nor the mean
over the workers)::

    horovodrun --gloo -np 2 -H localhost:2 python tests/noise_hvd_worker.py CONFIG_JSON OUT_DIR

Config: noise_worker's, plus ``predivide`` (the factor). Each rank writes rankR.json.
"""
import functools
import json
import os
import sys
import types

import horovod.mxnet as hvd

import noise_worker


def main():
    cfg, out = json.loads(sys.argv[1]), sys.argv[2]
    hvd.init()
    engine = types.SimpleNamespace(DistributedTrainer=functools.partial(
        hvd.DistributedTrainer, gradient_predivide_factor=cfg['predivide']))
    result = noise_worker.run(cfg, hvd.rank(), engine)
    with open(os.path.join(out, 'rank%d.json' % hvd.rank()), 'w') as f:
        json.dump(result, f)


if __name__ == '__main__':
    main()
