"""The benchmarks of mx_lbsgd (``mx-lbsgd bench`` runs some; ``python -m
mx_lbsgd_bench.bench_X`` or ``python benchmarks/bench_X.py`` runs each).

- :mod:`~mx_lbsgd_bench.bench_shapes`: step time, host syncs and operator calls against
  MXNet's optimizers at every model shape (``mx-lbsgd bench``'s default);
  :mod:`~mx_lbsgd_bench.bench_step`: the same on ResNet-50's shapes (superseded);
  :mod:`~mx_lbsgd_bench.bench_loss_scale`: the loss-scaled step against contrib.amp's checks;
  :mod:`~mx_lbsgd_bench.bench_window`: lblamb's accumulation window;
  :mod:`~mx_lbsgd_bench.bench_lamb`, :mod:`~mx_lbsgd_bench.bench_norms`,
  :mod:`~mx_lbsgd_bench.bench_sparse`, :mod:`~mx_lbsgd_bench.bench_noise_scale`,
  :mod:`~mx_lbsgd_bench.bench_dist` (2-worker dist_sync and Horovod jobs).

Built on public API only: the names in ``mx_lbsgd.__all__`` and its public submodules (never
``mx_lbsgd._*``), public MXNet and Horovod API, and the public names (``__all__``) of
:mod:`mx_lbsgd_demo`'s modules (its argument parsing; bench_noise_scale times the training
step of ``mx-lbsgd train``). The library never imports this package.
"""
__all__ = []
