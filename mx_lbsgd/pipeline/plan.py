"""The plan of one Updater call: what the update does with a group of tensors, computed once
per call signature (device and parameter indices) and kept while the Updater's state objects
stay the same; `run_plan` runs it.

A plan holds the split states, the master copies and accumulators, which tensors go one by
one through the family's sparse kernel, the trust-ratio exclusions, and the kernel routes:
each dense (dtype, master copy) group goes to the family's compiled kernel when it takes
the group, else to its per-tensor and multi-tensor kernels by tensor size
(`mx_lbsgd._kernels.route`, or as ``fused`` forces).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, cast

import mxnet as mx
from mxnet import nd

from .. import _identity, _kernels
from ..families.base import (GradNorm, Kernel, KernelFamily, KernelTrust, Masters,
                             SliceSums, SparseKernelFamily)
from .state import StateParts
from .trust_ratio import TrustRatio


@dataclasses.dataclass(frozen=True)
class Route:
    """One kernel call per step: the tensors at `positions` of the call, with what stays the
    same from step to step."""

    kernel: Kernel
    positions: List[int]
    states: List[Any]
    masters: Masters
    keep_lr: Optional[List[bool]]          # True: the layer keeps lr (no trust ratio)
    ratio_applies: Optional[List[bool]]    # not keep_lr, for families with the ratio inside
    native: bool                           # the family's compiled kernel
    trust: Optional[KernelTrust]           # the trust ratio the kernel computes (LARS)


@dataclasses.dataclass(frozen=True)
class SliceNorms:
    """The tensors of one dtype that a sharded Trainer split over ranks
    (`mx_lbsgd.ShardedTrainer`): the entry of each of this rank's pieces of them in a
    per-tensor vector, and the collective that sums such a vector over the ranks.

    Every rank calls `combine` once per update of the dtype, in `run_plan`, or the Trainer
    with zeros where this rank had none of that dtype to update (a skipped step included).

    Examples
    --------
    >>> from mxnet import nd
    >>> from mx_lbsgd.pipeline import SliceNorms
    >>> slices = SliceNorms(slots={7: 1}, entries=2, combine=lambda v: v * 3)  # 3 ranks
    >>> sums = slices.sums([7])
    >>> w_sq, g_sq = sums(nd.array([4.0]), nd.array([1.0]))
    >>> print(w_sq.asnumpy(), g_sq.asnumpy())
    [12.] [3.]
    """

    #: Trainer index -> entry, for this rank's pieces of split tensors
    slots: Mapping[int, int]
    #: entries per quantity: the split tensors of this dtype, over every rank
    entries: int
    #: a (2 * entries,) float32 device vector -> its sum over the ranks (asynchronous)
    combine: Callable[[nd.NDArray], nd.NDArray]

    def sums(self, index: Sequence[int]) -> SliceSums:
        """The `SliceSums` of a kernel call over this rank's pieces of `index`."""
        entries = self.entries
        slots = [self.slots[i] for i in index]

        def summed(first: nd.NDArray, second: nd.NDArray) -> Tuple[nd.NDArray, nd.NDArray]:
            ctx = first.context
            at = nd.array([slots + [s + entries for s in slots]], ctx=ctx, dtype='int32')
            vector = nd.scatter_nd(nd.concat(first, second, dim=0), at, shape=(2 * entries,))
            total = self.combine(vector)
            return (nd.take(total, at[0, :len(slots)]), nd.take(total, at[0, len(slots):]))
        return summed

    def nothing(self, ctx: mx.Context) -> None:
        """This rank's call of `combine` when it updates no piece of a split tensor."""
        self.combine(nd.zeros((2 * self.entries,), ctx=ctx))


@dataclasses.dataclass(frozen=True)
class Plan:
    """What an Updater call signature's update does (see the module docstring)."""

    state: List[Any]                  # the Updater's state objects this plan was made for
    states: List[Any]                 # the family's state per tensor
    masters: Masters                  # fp32 master copies (None: the weight is updated)
    accs: List[Optional[nd.NDArray]]  # accumulators (batch_scale > 1), else None
    sparse: List[int]                 # positions run one by one by the sparse kernel
    keep_lr: Optional[List[bool]]     # trust-ratio exclusions (None: no trust ratio)
    lars: bool                        # whether the routes carry the trust ratio (LARS)
    routes: List[Route]
    #: pieces of tensors split over ranks (`SliceNorms`), in two phases around one sum
    sliced: Optional[Route] = None

    @property
    def skips_on_device(self) -> bool:
        """Whether every tensor goes to a compiled kernel, which skips the update on the
        device when a clipping norm is not finite (MXNet's operators cannot)."""
        return not self.sparse and self.sliced is None and all(r.native for r in self.routes)

    def fits(self, state: Sequence[Any]) -> bool:
        """Whether the Updater still holds the state objects this plan was made for."""
        return _identity.same(self.state, state)


class PlanCache:
    """The plan of each call signature (context, indices), made once and re-made when the
    Updater's state objects change (states created or loaded)."""

    def __init__(self) -> None:
        self._plans: Dict[Any, Plan] = {}
        # per call signature: the weights and gradients whose shapes were found equal
        self._checked: Dict[Any, Tuple[List[nd.NDArray], List[nd.NDArray]]] = {}

    def get(self, index: List[Any], weight: List[mx.nd.NDArray], grad: List[mx.nd.NDArray],
            state: List[Any], *, family: KernelFamily, trust: Optional[TrustRatio],
            fused: Optional[bool], name: Callable[[Any], Optional[str]],
            split: Callable[[mx.nd.NDArray, Any], StateParts],
            check_shapes: bool = False, slices: Optional[SliceNorms] = None) -> Plan:
        """The plan of this call; `name` gives a parameter's name, `split` its state's parts
        (both validate, so a bad state or name fails before anything runs); `check_shapes`:
        refuse a gradient whose shape is not its weight's first; `slices`: the pieces of
        split tensors among `index` (a sharded Trainer's)."""
        key = (weight[0].context, tuple(index), slices is None)
        if check_shapes:
            self._check_shapes(key, index, weight, grad, name)
        plan = self._plans.get(key)
        if plan is not None and plan.fits(state):
            return plan
        parts = [split(w, s) for w, s in zip(weight, state)]
        names = [name(i) for i in index]
        plan = make_plan(family=family, trust=trust, fused=fused, names=names,
                         labels=[n or i for n, i in zip(names, index)], weight=weight,
                         grad=grad, state=state, parts=parts,
                         sliced=[] if slices is None else
                         [j for j, i in enumerate(index) if i in slices.slots])
        self._plans[key] = plan
        return plan

    def _check_shapes(self, key: Any, index: List[Any], weight: List[nd.NDArray],
                      grad: List[nd.NDArray], name: Callable[[Any], Optional[str]]) -> None:
        """Refuse a gradient whose shape is not its weight's, before anything changes (the
        compiled kernels see element counts alone; `name` gives a parameter's name);
        checked again when the call passes other array objects."""
        checked = self._checked.get(key)
        if checked is not None and _identity.same(checked[0], weight) \
                and _identity.same(checked[1], grad):
            return
        if len(grad) != len(weight):
            raise ValueError('an update call passed %d weights but %d gradients'
                             % (len(weight), len(grad)))
        for i, w, g in zip(index, weight, grad):
            if w.shape != g.shape:
                raise ValueError('the gradient of parameter %r has shape %s; it must have '
                                 "its weight's shape %s" % (name(i) or i, g.shape, w.shape))
        self._checked[key] = (list(weight), list(grad))


def make_plan(*, family: KernelFamily, trust: Optional[TrustRatio], fused: Optional[bool],
              names: List[Optional[str]], labels: List[Any], weight: Sequence[nd.NDArray],
              grad: Sequence[nd.NDArray], state: Sequence[Any],
              parts: List[StateParts], sliced: Sequence[int] = ()) -> Plan:
    """The plan of one call. `names`: parameter names (None when unknown); `labels`: what
    an error message calls each parameter; `sliced`: the positions of pieces of tensors
    split over ranks (run per tensor, with the whole tensors' norms)."""
    sparse = [j for j, (w, g) in enumerate(zip(weight, grad))
              if w.stype != 'default' or g.stype != 'default']
    if sparse and not family.supports_sparse:
        raise ValueError(family.sparse_refusal([labels[j] for j in sparse]))
    masters = [p.master for p in parts]
    keep = None if trust is None else [not trust.applies(n) for n in names]
    # the trust ratio from the shell's piece (LARS), unless every layer is excluded or the
    # family's kernels hold the ratio (LAMB)
    lars = keep is not None and not all(keep) and not family.trust_in_kernel
    routes = [_route(kernel, pos, parts, keep, native, trust if lars else None)
              for kernel, pos, native in _kernel_groups(family, fused, weight, masters,
                                                        sorted(set(sparse) | set(sliced)))
              if pos]
    by_piece = None
    if sliced:
        by_piece = _route(family.single_tensor, list(sliced), parts, keep, False,
                          None if keep is None or family.trust_in_kernel else trust)
    return Plan(state=list(state), states=[p.family_state for p in parts], masters=masters,
                accs=[p.accumulator for p in parts], sparse=sparse, keep_lr=keep, lars=lars,
                routes=routes, sliced=by_piece)


def _kernel_groups(family: KernelFamily, fused: Optional[bool],
                   weight: Sequence[nd.NDArray], masters: Masters,
                   apart: List[int]) -> List[Tuple[Kernel, List[int], bool]]:
    """(kernel, positions, native) for the tensors not `apart` (sparse ones, pieces of split
    tensors), by (dtype, master copy) group."""
    groups: Dict[Tuple[Any, bool], List[int]] = {}
    for j in range(len(weight)):
        if j not in apart:
            groups.setdefault((weight[j].dtype, masters[j] is None), []).append(j)
    device_type = weight[0].context.device_type
    out: List[Tuple[Kernel, List[int], bool]] = []
    for (dtype, no_master), members in groups.items():
        native = (None if fused is not None
                  else family.native_kernel(device_type, dtype, not no_master))
        if native is not None:      # the family's compiled kernel takes the whole group
            out.append((native, members, True))
            continue
        single, multi = _kernels.route([weight[j].size for j in members], device_type,
                                       fused, dtype)
        out += [(family.single_tensor, [members[p] for p in single], False),
                (family.multi_tensor, [members[p] for p in multi], False)]
    return out


def _route(kernel: Kernel, pos: List[int], parts: List[StateParts],
           keep: Optional[List[bool]], native: bool, trust: Optional[TrustRatio]) -> Route:
    keep_lr = None if keep is None else [keep[j] for j in pos]
    return Route(kernel=kernel, positions=pos, states=[parts[j].family_state for j in pos],
                 masters=[parts[j].master for j in pos], native=native, keep_lr=keep_lr,
                 ratio_applies=None if keep is None else [not keep[j] for j in pos],
                 trust=None if trust is None else trust.for_kernel(cast(List[bool], keep_lr)))


def run_plan(plan: Plan, *, family: KernelFamily, trust: Optional[TrustRatio],
             weight: Sequence[nd.NDArray], grad: Sequence[nd.NDArray], lrs: List[float],
             wds: List[float], steps: List[int], rescale_grad: float,
             clip_gradient: Optional[float], scratch: dict,
             grad_norm: Optional[GradNorm] = None, index: Sequence[Any] = (),
             slices: Optional[SliceNorms] = None) -> None:
    """Run every route of `plan` (and the sparse tensors one by one), the kernels computing
    the trust ratio with the update where the route has one (`Route.trust`). With
    `grad_norm` (global-norm clipping) the gradients are applied times its coefficient:
    the kernels fold it in, and the trust ratio sees the clipped gradient. With `slices`,
    the pieces of split tensors (`Plan.sliced`, whose parameters `index` names) take their
    whole tensors' norms from one collective, which runs even when there are none."""
    if slices is not None:
        route = plan.sliced
        if route is None:
            slices.nothing(weight[0].context)
        else:
            _run_route(route, family, weight, grad, lrs, wds, steps, rescale_grad,
                       clip_gradient, scratch, grad_norm,
                       sums=slices.sums([index[j] for j in route.positions]))
    for route in plan.routes:
        _run_route(route, family, weight, grad, lrs, wds, steps, rescale_grad,
                   clip_gradient, scratch, grad_norm)
    if plan.sparse:
        if grad_norm is not None:
            scaled = _kernels.scale_gradients([grad[j] for j in plan.sparse],
                                              grad_norm.coefficient())
            grad = list(grad)
            for j, g in zip(plan.sparse, scaled):
                grad[j] = g
        _run_sparse(plan, family, trust if plan.lars else None, weight, grad, lrs, wds,
                    rescale_grad, clip_gradient)


def _run_route(route: Route, family: KernelFamily, weight: Sequence[nd.NDArray],
               grad: Sequence[nd.NDArray], lrs: List[float], wds: List[float],
               steps: List[int], rescale_grad: float, clip_gradient: Optional[float],
               scratch: dict, grad_norm: Optional[GradNorm],
               sums: Optional[SliceSums] = None) -> None:
    pos = route.positions
    extra = {} if sums is None else {'sums': sums}
    family.run(route.kernel, weights=[weight[j] for j in pos], grads=[grad[j] for j in pos],
               states=route.states, masters=route.masters, lrs=[lrs[j] for j in pos],
               wds=[wds[j] for j in pos], trust=route.trust, rescale_grad=rescale_grad,
               clip_gradient=clip_gradient, scratch=scratch, steps=[steps[j] for j in pos],
               ratio_applies=route.ratio_applies, grad_norm=grad_norm, **extra)


def _run_sparse(plan: Plan, family: KernelFamily, trust: Optional[TrustRatio],
                weight: Sequence[nd.NDArray], grad: Sequence[nd.NDArray], lrs: List[float],
                wds: List[float], rescale_grad: float, clip_gradient: Optional[float]) -> None:
    pos = plan.sparse
    sparse_lrs = [lrs[j] for j in pos]
    if trust is not None:
        keep_lr = cast(List[bool], plan.keep_lr)        # (set with a trust ratio)
        for n, j in enumerate(pos):
            if not keep_lr[j] and grad[j].stype == 'row_sparse':
                master = plan.masters[j]
                sparse_lrs[n] *= trust.sparse_factor(
                    weight=master if master is not None else weight[j], grad=grad[j],
                    wd=wds[j], rescale_grad=rescale_grad)
    # a plan has sparse positions only when the family supports them (`make_plan`)
    cast(SparseKernelFamily, family).run_sparse(
        weights=[weight[j] for j in pos], grads=[grad[j] for j in pos],
        states=[plan.states[j] for j in pos], masters=[plan.masters[j] for j in pos],
        lrs=sparse_lrs, wds=[wds[j] for j in pos], rescale_grad=rescale_grad,
        clip_gradient=clip_gradient)
