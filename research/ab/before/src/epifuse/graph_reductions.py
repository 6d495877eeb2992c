"""Reduction elimination on an aten FX graph: sums and means whose value follows from how their
input was built are replaced by that value, computed from the small tensors it came from, so
no pass reads the whole input. The compile backend (epifuse.backend) runs this on the
post-grad forward and backward graphs before the fusion pass.

    one-hot row sum      sum(where(i == iota over d, a, b) [* f], d)
                         -> where(0 <= i < n, a + (n - 1) b, n b) [* f]
                         (n the size of dim d; i and f of size 1 along d, a and b scalars: the
                         cross-entropy backward's one-hot target, times the loss's gradient;
                         also scatter(full(b), d, i, a), whose indices torch checks are in range)
    softmax row sum      sum(E / sum(E, d, keepdim=True) [* f], d), E = exp(y - amax(y, d))
                         -> S / S [* f], S = sum(E, d): 1 (S lies in [1, n]), NaN where y holds NaN or infinities,
                         as the sum's
    mean of a broadcast  mean(expand(v), dims along which v has size 1)  ->  v
                         mean(full(shape, c))  ->  full(c) of the mean's shape

Each rule gives the value the reduction computes, up to the rounding the reduction would add
(1.0 rather than a sum of shares that rounds near it, a + (n - 1) b rounded once), NaN and
infinity included: a non-finite factor f gives NaN where a term of the sum would be 0 times
infinity (f - f is added for that where the one-hot's a or b is 0 or they differ in sign). The
one case that differs: a softmax row sum times an infinite factor, where a share underflowed to
0, is NaN in the sum and infinite here. Reductions over a dim of size 0 and graphs with
symbolic sizes (dynamic shapes) are left alone. Nodes the replacement leaves unused are erased.
`eliminate_reductions(graph)` returns (node name, rule) for each replaced reduction.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

aten = torch.ops.aten
prims = torch.ops.prims

_SUM = aten.sum.dim_IntList


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _is_call(node, target) -> bool:
    """Whether `node` is a call of `target`."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _unaliased(node):
    """`node`, or what the alias nodes it is (make_fx writes them) stand for."""
    while _is_call(node, aten.alias.default):
        node = node.args[0]
    return node


def reduced_dims(node, ndim: int) -> list | None:
    """The reduced dims of a sum or mean node, non-negative and sorted; None if unknown."""
    if ndim == 0:
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or dims == []:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % ndim for d in dims)


def _static(value) -> bool:
    """Whether `value` is a tensor of known sizes, none of them 0 (no symbolic size of dynamic
    shapes, no empty reduction whose mean or sum of shares differs from the rules')."""
    return isinstance(value, torch.Tensor) and all(isinstance(s, int) and s > 0 for s in value.shape)


def keeps_dims(node) -> bool:
    """A reduction node's keepdim."""
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


_FAKE_MODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # graph -> the fake mode of its values


def _fake_mode(graph):
    """The fake tensor mode of `graph`'s values (a null context where they are real tensors)."""
    if graph not in _FAKE_MODES:
        from torch._guards import detect_fake_mode
        values = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        _FAKE_MODES[graph] = detect_fake_mode(values)
    return _FAKE_MODES[graph] or contextlib.nullcontext()


def _emit(graph, target, args, kwargs=None):
    """A new node, its value computed from its inputs' in the graph's fake mode (so later passes
    and Inductor see its shape and dtype)."""
    kwargs = kwargs or {}
    node = graph.call_function(target, tuple(args), kwargs)
    values = [_val(a) if isinstance(a, torch.fx.Node) else a for a in args]
    with _fake_mode(graph):
        node.meta["val"] = target(*values, **kwargs)
    return node


def _scalar(node):
    """A Python number for a scalar operand: a number, scalar_tensor(c) or full([], c); else None."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return node
    if isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is aten.scalar_tensor.default:
            return node.args[0]
        if node.target is aten.full.default and list(node.args[0]) == []:
            return node.args[1]
    return None


def _iota_along(node, dim: int, ndim: int) -> int | None:
    """n where `node` is iota(n) (start 0, step 1), reshaped or not, of size n along `dim` and 1
    along every other dim of an `ndim`-dim tensor it broadcasts against (trailing-aligned)."""
    def along(value) -> bool:
        if not _static(value) or value.dim() > ndim:
            return False
        shape = (1,) * (ndim - value.dim()) + tuple(value.shape)
        return all(s == 1 for k, s in enumerate(shape) if k != dim)
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in (
            aten.reshape.default, aten.view.default, aten.unsqueeze.default):
        if not along(_val(node)):
            return None
        node = node.args[0]
    if not _is_call(node, prims.iota.default):
        return None
    if node.kwargs.get("start", 0) != 0 or node.kwargs.get("step", 1) != 1 or not along(_val(node)):
        return None
    return node.args[0] if isinstance(node.args[0], int) else None


def _size_one_along(node, dims: list, ndim: int) -> bool:
    value = _val(node)
    return _static(value) and value.dim() == ndim and all(value.shape[d] == 1 for d in dims)


def _unexpanded(node, dims: list, ndim: int):
    """`node`, or the input it expands, where that has size 1 along `dims`; else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    if _size_one_along(node, dims, ndim):
        return node
    if node.op == "call_function" and node.target is aten.expand.default and _size_one_along(node.args[0], dims, ndim):
        return node.args[0]
    return None


def _peeled(x, dims: list, ndim: int) -> tuple:
    """(inner, factors): `x` as inner * factor * ..., each factor constant along `dims` (size 1
    there, or expanded from size 1), so it can leave a sum over them."""
    factors = []
    while _is_call(x, aten.mul.Tensor):
        left, right = x.args
        if _unexpanded(right, dims, ndim) is not None:
            factors.append(_unexpanded(right, dims, ndim))
            x = left
        elif _unexpanded(left, dims, ndim) is not None:
            factors.append(_unexpanded(left, dims, ndim))
            x = right
        else:
            break
    return x, factors


def _one_hot(x, dims: list, ndim: int):
    """(index, n, a, b) where `x` is one-hot along the single dim in `dims`: a at column index[r]
    of each row r and b elsewhere, as where(index == iota, a, b) or scatter(full(b), d, index, a)
    (index of size 1 along d, integer); else None."""
    if len(dims) != 1 or not (isinstance(x, torch.fx.Node) and x.op == "call_function"):
        return None
    d, shape = dims[0], tuple(_val(x).shape)
    dtypes = [_val(x).dtype]   # what a and b pass through, last first: x's, then what x converts
    if x.target is prims.convert_element_type.default and isinstance(x.args[0], torch.fx.Node) \
            and _val(x.args[0]) is not None:
        x = x.args[0]
        dtypes.append(_val(x).dtype)
        if x.op != "call_function":
            return None
    if not all(t.is_floating_point for t in dtypes):
        return None   # an integer or bool one-hot rounds a and b in ways the rule does not follow
    if x.target is aten.scatter.value:
        base, dim, index, a = x.args
        if not isinstance(dim, int) or dim % ndim != d or not (isinstance(base, torch.fx.Node)
                                                               and base.target is aten.full.default):
            return None
        b = base.args[1]
        value = _val(index)
        if not _static(value) or tuple(value.shape) != shape[:d] + (1,) + shape[d + 1:]:
            return None   # an index narrower than the rows would leave rows without their a
        n = shape[d]
    elif x.target is aten.where.self:
        cond, a, b = x.args
        a, b = _scalar(a), _scalar(b)
        if not _is_call(cond, aten.eq.Tensor):
            return None
        n = index = None
        for left, right in (cond.args, tuple(reversed(cond.args))):
            n = _iota_along(right, d, ndim)
            index = _unexpanded(left, dims, ndim) if n is not None else None
            if index is not None:
                break
        if index is None or n != shape[d]:
            return None
    else:
        return None
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or isinstance(a, bool) or isinstance(b, bool):
        return None
    if _val(index).dtype.is_floating_point or _val(index).dtype is torch.bool:
        return None
    for dtype in reversed(dtypes):   # a and b as the graph holds them: made in the one-hot's dtype, then converted
        a, b = (torch.tensor(v, dtype=dtype).item() for v in (a, b))
    return index, n, a, b


def _one_hot_row_sum(graph, x, dims: list, ndim: int):
    """(where(0 <= index < n, a + (n - 1) b, n b), whether a non-finite factor makes a term 0
    times infinity or two of opposite infinities): the sum along d of a one-hot `x` (keepdim)."""
    found = _one_hot(x, dims, ndim)
    if found is None:
        return None
    index, n, a, b = found
    value = _val(x)
    inside = _emit(graph, aten.bitwise_and.Tensor, [_emit(graph, aten.ge.Scalar, [index, 0]),
                                                     _emit(graph, aten.lt.Scalar, [index, n])])
    hit = _emit(graph, aten.scalar_tensor.default, [float(a + (n - 1) * b)], {"dtype": value.dtype, "device": value.device})
    miss = _emit(graph, aten.scalar_tensor.default, [float(n * b)], {"dtype": value.dtype, "device": value.device})
    return _emit(graph, aten.where.self, [inside, hit, miss]), a == 0 or b == 0 or a * b < 0


def _share_sum(graph, x, dims: list, ndim: int):
    """(S / S, False) where `x` is a softmax E / S over dims, E = exp(y - amax(y, dims)) and S =
    sum(E, dims, keepdim=True): the sum of `x` over dims (keepdim). E lies in [0, 1], so S lies
    in [1, n] wherever y is finite: no overflow or cancellation makes the sum of shares differ."""
    if not _is_call(x, aten.div.Tensor):
        return None
    share, total = _unaliased(x.args[0]), x.args[1]
    if not (_is_call(total, _SUM) and total.args[0] is share and keeps_dims(total) and reduced_dims(total, ndim) == dims):
        return None
    if not (_is_call(share, aten.exp.default) and _is_call(share.args[0], aten.sub.Tensor)):
        return None
    y, peak = share.args[0].args
    if not (_is_call(peak, aten.amax.default) and peak.args[0] is y and keeps_dims(peak) and reduced_dims(peak, ndim) == dims):
        return None
    if _val(total) is None or _val(total).dtype != _val(x).dtype:
        return None
    return _emit(graph, aten.div.Tensor, [total, total]), False


def _sum_of_known(graph, node):
    """The value of a sum over dims whose input is, up to factors constant along them, a one-hot
    matrix or a share of its own sum, inserted before `node`; None where it is neither."""
    x = _unaliased(node.args[0])
    value = _val(x)
    if not _static(value) or not value.dtype.is_floating_point or value.dim() == 0:
        return None
    ndim = value.dim()
    dims = reduced_dims(node, ndim)
    inner, factors = _peeled(x, dims, ndim)
    inner = _unaliased(inner)
    if _val(inner) is None or tuple(_val(inner).shape) != tuple(value.shape):
        return None
    with graph.inserting_before(node):
        for rule, said in ((_one_hot_row_sum, "the row sum of a one-hot matrix"),
                           (_share_sum, "the row sum of a softmax")):
            found = rule(graph, inner, dims, ndim)
            if found is not None:
                break
        else:
            return None
        result, guard = found
        for factor in reversed(factors):
            result = _emit(graph, aten.mul.Tensor, [result, factor])
            if guard:   # NaN where the factor is not finite, as a term 0 * inf (or inf - inf) makes the sum
                result = _emit(graph, aten.add.Tensor, [result, _emit(graph, aten.sub.Tensor, [factor, factor])])
        if not keeps_dims(node):
            result = _emit(graph, aten.squeeze.dims, [result, dims])
    result.meta["eliminated"] = said + (" times factors constant along it" if factors else "")
    return result


def _broadcast_mean(graph, node):
    """The value of a mean over dims along which its input is a broadcast or a constant, inserted
    before `node`; None where it is neither."""
    x = node.args[0]
    value, out = _val(x), _val(node)
    if not (_static(value) and isinstance(out, torch.Tensor) and value.dtype.is_floating_point and value.dim() > 0):
        return None
    ndim = value.dim()
    dims = reduced_dims(node, ndim) if node.target is aten.mean.dim else list(range(ndim))
    if not (isinstance(x, torch.fx.Node) and x.op == "call_function"):
        return None
    if x.target is aten.full.default and len(x.args) > 1:
        with graph.inserting_before(node):
            return _emit(graph, aten.full.default, [list(out.shape), x.args[1]],
                         {"dtype": out.dtype, "device": out.device})
    if x.target is not aten.expand.default:
        return None
    source = _val(x.args[0])
    if not _static(source) or source.dtype != out.dtype or source.numel() != out.numel():
        return None   # a kept dim expanded too: the mean is the source broadcast, not reshaped
    lead = ndim - source.dim()   # expand may add leading dims
    if any(k >= lead and source.shape[k - lead] != 1 for k in dims):
        return None
    with graph.inserting_before(node):
        return _emit(graph, aten.reshape.default, [x.args[0], list(out.shape)])   # numel matches: only size-1 dims reduced


def _erase_unused(graph, node, erased: set) -> None:
    """Erase `node` and, in turn, every call it was the last user of (pure ops only); adds
    each erased node to `erased`."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op != "call_function" or n.is_impure():
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)


_RULES = ((_SUM, _sum_of_known), (aten.mean.dim, _broadcast_mean), (aten.mean.default, _broadcast_mean))


def eliminate_reductions(graph: torch.fx.Graph) -> list:
    """Replace (in place) every reduction of `graph` a rule above computes from smaller tensors;
    returns (node name, rule) for each."""
    done, erased = [], set()
    for node in list(graph.nodes):
        if node in erased or node.op != "call_function":
            continue
        for target, rule in _RULES:
            if node.target is not target:
                continue
            replacement = rule(graph, node)
            if replacement is None:
                continue
            if tuple(_val(replacement).shape) != tuple(_val(node).shape) or _val(replacement).dtype != _val(node).dtype:
                _erase_unused(graph, replacement, erased)   # a rule's result that does not fit: keep the reduction
                continue
            name, said = node.name, replacement.meta.pop("eliminated", "the mean of a broadcast value")
            node.replace_all_uses_with(replacement)
            _erase_unused(graph, node, erased)
            done.append((name, said))
            break
    return done


__all__ = ["eliminate_reductions", "reduced_dims", "keeps_dims"]
