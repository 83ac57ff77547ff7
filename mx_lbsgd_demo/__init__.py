"""The ``mx-lbsgd`` command and its demos, built on mx_lbsgd's public API only (the names in
``mx_lbsgd.__all__`` and its public submodules, never ``mx_lbsgd._*``).

- :mod:`~mx_lbsgd_demo.cli`: the command (``python -m mx_lbsgd_demo`` runs it too);
  :mod:`~mx_lbsgd_demo.train_command` and :mod:`~mx_lbsgd_demo.schedule_command` its
  ``train`` and ``schedule``; :mod:`~mx_lbsgd_demo.args`: one-line argument errors, the
  ``demo`` extra check.
- :mod:`~mx_lbsgd_demo.config`, :mod:`~mx_lbsgd_demo.train`: one training run on the digits
  (:mod:`~mx_lbsgd_demo.data`) of an MLP (:mod:`~mx_lbsgd_demo.models`);
  :mod:`~mx_lbsgd_demo.summary`, :mod:`~mx_lbsgd_demo.plots`: what it writes.
- :mod:`~mx_lbsgd_demo.study` (:mod:`~mx_lbsgd_demo.study_report`): accuracy against batch
  size; :mod:`~mx_lbsgd_demo.mlm`: masked-LM pre-training with lblamb.

``mx-lbsgd bench`` runs the benchmarks of the separate package :mod:`mx_lbsgd_bench`.
The library (``mx_lbsgd``) never imports this package. scikit-learn, tqdm and matplotlib
(the ``demo`` extra) are imported where used, so ``import mx_lbsgd_demo.cli`` needs only
MXNet and NumPy.
"""
__all__ = []
