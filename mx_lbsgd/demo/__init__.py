"""The ``mx-lbsgd`` command and its demos, built on mx_lbsgd's public API only.

- :mod:`~mx_lbsgd.demo.cli`: the command; :mod:`~mx_lbsgd.demo.train_command` and
  :mod:`~mx_lbsgd.demo.schedule_command` its ``train`` and ``schedule``;
  :mod:`~mx_lbsgd.demo.args`: one-line argument errors, the ``demo`` extra check.
- :mod:`~mx_lbsgd.demo.config`, :mod:`~mx_lbsgd.demo.train`: one training run on the digits
  (:mod:`~mx_lbsgd.demo.data`) of an MLP (:mod:`~mx_lbsgd.demo.models`);
  :mod:`~mx_lbsgd.demo.summary`, :mod:`~mx_lbsgd.demo.plots`: what it writes.
- :mod:`~mx_lbsgd.demo.study` (:mod:`~mx_lbsgd.demo.study_report`): accuracy against batch
  size; ``bench_step``, ``bench_shapes``, ``bench_loss_scale``, ``bench_sparse``,
  ``bench_dist``: the benchmarks (``benchmarks/*.py`` wrap them).

The library never imports this package. scikit-learn, tqdm and matplotlib (the ``demo``
extra) are imported where used, so ``import mx_lbsgd.demo.cli`` needs only MXNet and NumPy.
"""
__all__ = []
