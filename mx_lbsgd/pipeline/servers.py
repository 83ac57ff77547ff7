"""What a dist kvstore's servers cannot do, refused before the optimizer is sent to them
(``kv.set_optimizer`` pickles it with protocol 0, on the worker) or before a Trainer's first
reduction: loss scaling and clipping, row_sparse gradients of dense weights, and a
per-tensor trust ratio of a tensor the kvstore splits across servers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from .. import _compat
from .trust_ratio import refuse_split_ratios

if TYPE_CHECKING:
    from .optimizer_view import StepOptimizer


def refuse_server_updates(opt: StepOptimizer) -> None:
    """Everything refused when `opt` is about to be sent to the servers of a dist kvstore
    (``kv.set_optimizer`` pickles it with protocol 0, on the worker, in Python: an
    exception raised here reaches the script that created the Trainer or called
    ``Module.init_optimizer``/``fit``, before any weight is pushed or updated).

    - loss scaling and clipping (`PipelineOptimizer.refuse_updates_on_kvstore`);
    - row_sparse gradients of dense weights (Module; Gluon's are refused at binding);
    - a per-tensor trust ratio of a tensor the kvstore splits across several servers
      (`trust_ratio.refuse_split_ratios`): the sizes come from the Trainer's
      ``param_dict`` (Gluon) or from the Module being initialized; parameters without a
      gradient (``grad_req='null'``, Module's fixed parameters) are never updated."""
    opt.refuse_updates_on_kvstore()
    kind, names = _compat.module_sparse_gradients_on_dist_kvstore()
    refuse_sparse_gradients_on_servers(names, kind, type(opt).__name__)
    sizes = ({p.name: int(np.prod(p.shape)) for p in opt.param_dict.values()
              if p.grad_req != 'null'} if opt.param_dict
             else _compat.module_trained_parameter_sizes())
    refuse_split_ratios(type(opt).__name__, sizes, opt.trust_ratio_applies)


def refuse_sparse_gradients_on_servers(names: Sequence[str], kind: Optional[str],
                                       owner: str) -> None:
    """Dense weights with row_sparse gradients on a dist kvstore: MXNet 1.9.1 pushes the
    sparse gradients into keys initialized dense, and the server aborts ("copying size
    mismatch"; with mx.optimizer.SGD too). Refuse before anything is sent (Gluon: here;
    Module: when its optimizer is pickled for the servers)."""
    if names:
        raise ValueError(
            '%s: parameter(s) %s have dense weights and row_sparse gradients '
            "(Embedding(sparse_grad=True)), which MXNet 1.9.1's %r kvstore cannot reduce (its "
            'server aborts, with mx.optimizer.SGD too). Use gluon.contrib.nn.SparseEmbedding '
            "(row_sparse weights, updated on the servers), sparse_grad=False, or a 'local' or "
            "'device' kvstore" % (owner, ', '.join(map(repr, names)), kind))
