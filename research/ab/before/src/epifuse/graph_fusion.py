"""GEMMs and the pointwise ops and reductions that consume them, found in an aten FX graph and
rewritten as one `torch.ops.epifuse.gemm` call each: the fusion pass of the torch.compile
backend (epifuse.backend), run on the forward and the backward graphs that AOTAutograd and
Inductor's decompositions leave (post-grad), before Inductor lowers the rest.

A region starts at a 2-D `mm` (or `addmm`, whose bias is one more operand added to accum) or a
batched `bmm`, and grows through its users while each is an op of `POINTWISE` (or a reduction
of `REDUCTIONS`, which ends its branch) and each of its other inputs is an operand the epilogue
can read: a Python number, or a tensor computed outside the region that broadcasts to accum's
(M, N) or (L, M, N) without growing it (a scalar, a row (N,) / (1, N), a column (M, 1), a full
tile, and for bmm each of those per batch or shared). An operand that a pointwise op computes
from such values and that nothing else reads is computed in the epilogue instead (`1 - target`:
no pass writes it whole). Reductions over some dims or over every dim (a loss's mean, 0-d)
end a branch. Every region value used
outside the region becomes an output of the epilogue, in its node's dtype (accum itself
included, when something else reads it). The epilogue is printed as source, registered with
the custom ops, and the region's nodes are replaced by the op's outputs. So the activation of a
forward Linear joins its GEMM, and in the backward the activation's derivative and the bias
gradient (a column sum) join the GEMM that produces the incoming gradient.

A Linear over (B, S, features) is an `mm` over a view of its input to 2-D whose result is viewed
back to three dims: the region passes through views that only split or merge accum's rows,
computing in accum's (M, N) shape and reading operands of the (B, S, N) shape as views of its
rows (_row_operand; reductions' dims mapped by _row_dims).

An `mm` whose result is split into its two column halves (`gate, up = (x @ W).chunk(2, dim=-1)`
over a merged weight) gets a gated epilogue (`gate, up = accum.chunk(2, dim=-1)`): the region's
values are then N / 2 wide, and the whole result, where something else reads it (the backward
saves it), is the output `cat((gate, up), dim=-1)`. Two `mm`s of one input over separate weights
whose results meet (`silu(x @ Wg) * (x @ Wu)`) are reported, not merged (a copy of both weights
per step).

Not fused (left to Inductor, with the reason `fuse_gemms` reports): `baddbmm`, GEMMs without a
pointwise consumer, integer GEMMs, and values of dtypes the
kernels do not store. A chain between two GEMMs always joins the producer's epilogue (no
prologue fusion yet).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch

from . import epilogue_table, torch_ops
from .graph_reductions import keeps_dims, reduced_dims
from .printing import number_literal
from .shapes import bytes_per_output

aten = torch.ops.aten
prims = torch.ops.prims

# aten op -> (epifuse op, how its arguments map): "args" passes the tensor/number arguments in
# order; a callable builds (op name, args, params) from the node itself.
_UNARY = {
    aten.relu.default: "relu", aten.sigmoid.default: "sigmoid", aten.tanh.default: "tanh",
    aten.exp.default: "exp", aten.log.default: "log", aten.erf.default: "erf", aten.neg.default: "neg",
    aten.abs.default: "abs", aten.sqrt.default: "sqrt", aten.rsqrt.default: "rsqrt",
    aten.reciprocal.default: "reciprocal", aten.sin.default: "sin", aten.cos.default: "cos",
    aten.expm1.default: "expm1", aten.log1p.default: "log1p", aten.sign.default: "sign",
    aten.silu.default: "silu", aten.exp2.default: "exp2", aten.log2.default: "log2",
}
_BINARY = {
    aten.add.Tensor: "add", aten.sub.Tensor: "sub", aten.mul.Tensor: "mul", aten.div.Tensor: "div",
    aten.maximum.default: "maximum", aten.minimum.default: "minimum",
    aten.eq.Tensor: "eq", aten.ne.Tensor: "ne", aten.gt.Tensor: "gt", aten.ge.Tensor: "ge",
    aten.lt.Tensor: "lt", aten.le.Tensor: "le",
    aten.eq.Scalar: "eq", aten.ne.Scalar: "ne", aten.gt.Scalar: "gt", aten.ge.Scalar: "ge",
    aten.lt.Scalar: "lt", aten.le.Scalar: "le",
    aten.pow.Tensor_Scalar: "pow", aten.pow.Tensor_Tensor: "pow",
}
POINTWISE = {*_UNARY, *_BINARY, aten.where.self, aten.gelu.default, aten.clamp.default,
             aten.clamp_min.default, aten.clamp_max.default, prims.convert_element_type.default,
             aten.add.Scalar, aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar, aten.rsub.Scalar}
REDUCTIONS = {aten.sum.dim_IntList: "sum", aten.amax.default: "max", aten.amin.default: "min",
              aten.mean.dim: "mean", aten.sum.default: "sum", aten.mean.default: "mean"}
_OVER_EVERY_DIM = (aten.sum.default, aten.mean.default)   # a loss's mean: a 0-d result

# dtypes a fused output may be stored in, and what the epilogue computes in
_STORED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class Fused:
    """One rewritten region: the epilogue's source and the nodes it replaced."""

    source: str
    gemm: str
    replaced: list = field(default_factory=list)


@dataclass
class Report:
    """What one run of the pass did: the fused regions, and each GEMM left as it was, with why
    (and, from the backend's reduction elimination before it, each reduction replaced)."""

    fused: list = field(default_factory=list)
    skipped: list = field(default_factory=list)   # (gemm node name, reason)
    notes: list = field(default_factory=list)     # (gemm node names, what a model change would let fuse)
    eliminated: list = field(default_factory=list)   # (reduction node name, rule): graph_reductions


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _is_gemm(node) -> bool:
    return node.op == "call_function" and node.target in (aten.mm.default, aten.addmm.default, aten.bmm.default)


def _reads(value, shape: tuple) -> bool:
    """Whether a tensor operand broadcasts to accum's `shape` ((M, N) or (L, M, N)) without
    growing it: what an epilogue operand may be."""
    if value.dim() > len(shape):
        return False
    try:
        return tuple(torch.broadcast_shapes(tuple(value.shape), shape)) == shape
    except RuntimeError:
        return False


class _Region:
    """The nodes of one region, the operands they read, and the source being printed."""

    def __init__(self, gemm, shape: tuple):
        self.gemm, self.shape = gemm, shape
        self.nodes: list = [gemm]
        self.names: dict = {gemm: "accum"}
        self.operands: dict = {}   # outside node -> param name
        self.inlined: dict = {}    # outside node -> its expression, which the epilogue computes (_inlined)
        self.depth = 0             # how deep _inlined is now
        self.lines: list[str] = []
        self.gated = False         # accum chunked into its two column halves (_halves)
        self.rows: tuple | None = None   # accum's rows viewed as several dims, (B, S, N) for (B * S, N)
        self.in_rows: dict = {gemm: False}   # region node -> whether its value has the rows view's shape
        self.current = shape       # the shape of the node being added: accum's, or the rows view's
        self.transparent: set = set()   # nodes that name a value without computing one (views, halves)
        self.whole: set = {gemm}   # nodes whose value is all of accum (only an output, once accum is chunked)
        self.operand_views: dict = {}   # operand node -> the 2-D shape it is read as (_row_operand)

    def save(self) -> tuple:
        return dict(self.operands), dict(self.inlined), dict(self.operand_views)

    def restore(self, saved: tuple) -> None:
        """Forget the operands and inlined nodes that an expression which failed had named."""
        self.operands, self.inlined, self.operand_views = dict(saved[0]), dict(saved[1]), dict(saved[2])

    def operand(self, node) -> str:
        if node not in self.operands:
            self.operands[node] = f"x{len(self.operands)}"
        return self.operands[node]


def _literal(value) -> str | None:
    """A Python number as epilogue source (printing.number_literal), or None for anything else."""
    return number_literal(value) if isinstance(value, (bool, int, float)) else None


def _expression(node, region: _Region, descendants: set) -> tuple[str, bool] | None:
    """(the epilogue expression for `node`, whether it ends a branch: a reduction), or None
    where the node cannot join the region (its reason is the caller's: not fused)."""
    target = node.target

    def arg(a):
        if isinstance(a, torch.fx.Node):
            if a in region.names:
                return region.names[a]
            if a in descendants:     # computed from the region outside it: would make a cycle
                return None
            inlined = _inlined(a, region, descendants)
            if inlined is not None:
                return inlined
            v = _val(a)
            if v is None or not isinstance(v, torch.Tensor) or not (v.dtype.is_floating_point or v.dtype is torch.bool):
                return None
            if not _reads(v, region.current):
                return None
            if region.current != region.shape:   # in the rows view: read as a 2-D operand of accum's rows
                view = _row_operand(v, region.current, region.shape)
                if view is False or region.operand_views.get(a, view) != view:
                    return None
                if view is not None:
                    region.operand_views[a] = view
            if v.dtype is torch.bool:   # read as uint8 0 and 1, and compared back to a bool
                return f"gt({region.operand(a)}, 0.5)"
            return region.operand(a)
        return _literal(a)

    if node.kwargs and target not in (aten.gelu.default, prims.convert_element_type.default,
                                      aten.clamp.default, aten.where.self):
        return None
    if target in _UNARY:
        x = arg(node.args[0])
        return (f"{_UNARY[target]}({x})", False) if x is not None else None
    if target in _BINARY or target in (aten.add.Scalar, aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar):
        if len(node.args) != 2:
            return None
        name = _BINARY.get(target) or {aten.add.Scalar: "add", aten.mul.Scalar: "mul", aten.sub.Scalar: "sub",
                                       aten.div.Scalar: "div"}[target]
        a, b = arg(node.args[0]), arg(node.args[1])
        return (f"{name}({a}, {b})", False) if a is not None and b is not None else None
    if target is aten.rsub.Scalar:   # other - x (alpha 1 only)
        if len(node.args) != 2 or node.kwargs:
            return None
        x, other = arg(node.args[0]), arg(node.args[1])
        return (f"sub({other}, {x})", False) if x is not None and other is not None else None
    if target is aten.where.self:
        parts = [arg(a) for a in node.args]
        return (f"where({', '.join(parts)})", False) if None not in parts and len(parts) == 3 else None
    if target is aten.gelu.default:
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        x = arg(node.args[0])
        return (f"gelu({x}, approximate={approximate!r})", False) if x is not None else None
    if target in (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default):
        x = arg(node.args[0])
        if x is None:
            return None
        if target is aten.clamp_min.default:
            low, high = node.args[1], None
        elif target is aten.clamp_max.default:
            low, high = None, node.args[1]
        else:
            low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
            high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
        bounds = [f"{k}={_literal(v)}" for k, v in (("min", low), ("max", high)) if v is not None]
        if any(_literal(v) is None for v in (low, high) if v is not None) or not bounds:
            return None
        return f"clamp({x}, {', '.join(bounds)})", False
    if target is prims.convert_element_type.default:
        x, dtype = arg(node.args[0]), node.args[1]
        if x is None or dtype not in _STORED:
            return None
        source = _val(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
        if source is not None and source.dtype is torch.bool:   # a mask as 0.0 / 1.0
            x = f"where({x}, 1.0, 0.0)"
        if dtype in (torch.float32, torch.float64):   # the epilogue computes in float32 or float64
            return x, False
        return f"to({x}, dtype={str(dtype).removeprefix('torch.')!r})", False
    if target in _OVER_EVERY_DIM:
        x = arg(node.args[0])
        if x is None or node.kwargs.get("dtype") is not None:
            return None
        return f"{REDUCTIONS[target]}({x})", True
    if target in REDUCTIONS:
        x = arg(node.args[0])
        if x is None or not (len(node.args) > 1 and node.args[1]) or node.kwargs.get("dtype") is not None:
            return None
        dims = tuple(reduced_dims(node, len(region.current)))
        if region.current != region.shape:
            dims = _row_dims(dims, len(region.current))
            if dims is None:
                return None
        return f"{REDUCTIONS[target]}({x}, dim={dims}, keepdim={keeps_dims(node)})", True
    return None


INLINE_DEPTH = 8   # how many pointwise ops deep an operand's own computation is taken in


def _inlined(node, region: _Region, descendants: set) -> str | None:
    """The expression of an operand that pointwise ops compute from values outside the region,
    so the epilogue computes it from its inputs, at most INLINE_DEPTH ops deep; None where it
    stays an operand. Taken in where nothing else reads it (`1 - target` in a BCE loss: no
    pass writes it whole), or where what it is computed from is fewer bytes to read than it is
    (a GELU backward's fp32 values computed from the bf16 pre-activation: the other readers
    keep their pass, the epilogue reads the bf16 tensor)."""
    if node in region.inlined:   # read twice (x * x): computed from the same expression
        return region.inlined[node]
    v = _val(node)
    if (region.depth >= INLINE_DEPTH or node.op != "call_function" or node.target not in POINTWISE
            or not isinstance(v, torch.Tensor) or v.dtype not in _STORED or not _reads(v, region.current)):
        return None
    saved = region.save()
    region.depth += 1
    try:
        found = _expression(node, region, descendants)
    finally:
        region.depth -= 1
    if found is not None and len(node.users) != 1:
        added = [n for n in region.operands if n not in saved[0]]
        elements = math.prod(region.current)
        if bytes_per_output([_val(n) for n in added], elements) >= bytes_per_output([v], elements):
            found = None   # no fewer bytes to read than the operand itself
    if found is None:   # what the attempt named is not read after all
        region.restore(saved)
        return None
    region.inlined[node] = found[0]
    return found[0]


def _descendants(node) -> set:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for user in n.users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _row_operand(value, rows: tuple, shape: tuple):
    """How an operand that broadcasts to the rows view `rows` ((B, S, N) of accum's (M, N)) is
    read in accum's shape: None as it is (a scalar or a row), the 2-D shape it is viewed to
    ((1, N) or (M, N), or with a last dim of 1), or False where no view gives it (broadcast
    along some of the leading dims only, or strides a view cannot merge)."""
    if value.dim() <= 1:
        return None
    full = (1,) * (len(rows) - value.dim()) + tuple(value.shape)
    lead, last = full[:-1], full[-1]
    if all(n == 1 for n in lead):
        target = (1, last)
    elif lead == tuple(rows[:-1]):
        target = (shape[0], last)
    else:
        return False
    try:
        value.view(target)
    except (RuntimeError, ValueError):   # fake tensors raise ValueError where strides do not merge
        return False
    return target


def _row_dims(dims: tuple, rank: int):
    """A reduction's dims over the rows view (rank dims, the last accum's columns) as dims of
    accum: every leading dim is accum's dim 0, the last its dim 1; None where only some of the
    leading dims are reduced."""
    lead = set(range(rank - 1)) & set(dims)
    if lead and lead != set(range(rank - 1)):
        return None
    return ((0,) if lead else ()) + ((1,) if rank - 1 in dims else ())


def _splits_rows(shape: tuple, accum: tuple) -> bool:
    """Whether `shape` views accum's (M, N) rows as several dims: (B, S, N) with B * S = M."""
    return (len(shape) >= 3 and all(isinstance(n, int) for n in shape) and shape[-1] == accum[1]
            and math.prod(shape[:-1]) == accum[0])


def _rows_view(node, region: _Region):
    """Where `node` views a region value between accum's shape and a rows view of it (the
    (B * S, N) <-> (B, S, N) of a Linear over three dims), whether its value is in the rows
    view; None where it is another view."""
    source, v = node.args[0], _val(node)
    if source not in region.in_rows or source in region.whole and region.gated or v is None or len(region.shape) != 2:
        return None
    shape = tuple(v.shape)
    if not all(isinstance(n, int) for n in shape):
        return None
    if region.in_rows[source]:
        return False if shape == region.shape else None
    return True if _splits_rows(shape, region.shape) and region.rows in (None, shape) else None


def _halves(gemm, shape: tuple):
    """(rows view or None, split, first half, second half) where an `mm`'s result is read as
    its two column halves (`gate, up = (x @ W).chunk(2, dim=-1)`, which the decompositions
    leave as a split and two getitems), directly or through a view of its rows as several dims
    (a Linear over (B, S, features)); other readers of the whole result are allowed. None
    where it is not."""
    if gemm.target is not aten.mm.default or len(shape) != 2 or not isinstance(shape[1], int) or shape[1] % 2:
        return None
    views = [u for u in gemm.users if u.op == "call_function" and u.target in _VIEWS and not u.kwargs
             and _val(u) is not None and _splits_rows(tuple(_val(u).shape), shape)]
    for view in (None, *views):
        source = gemm if view is None else view
        rank = 2 if view is None else len(_val(view).shape)
        for split in source.users:
            if split.op != "call_function" or split.target is not aten.split.Tensor or split.kwargs:
                continue
            size, dim = split.args[1], (split.args[2] if len(split.args) > 2 else 0)
            if size != shape[1] // 2 or dim not in (rank - 1, -1):
                continue
            items = {u.args[1]: u for u in split.users if u.target is operator.getitem}
            if len(items) == len(split.users) == 2 and set(items) == {0, 1}:
                return view, split, items[0], items[1]
    return None


def _grow(gemm, shape: tuple) -> _Region:
    region = _Region(gemm, shape)
    descendants = _descendants(gemm)
    halves = _halves(gemm, shape)
    if halves is not None:   # a gated epilogue: its values are N / 2 wide; accum whole is the halves' cat
        view, split, first, second = halves
        shape = region.shape = (shape[0], shape[1] // 2)
        region.lines.append("    gate, up = accum.chunk(2, dim=-1)")
        region.names.update({gemm: "cat((gate, up), dim=-1)", first: "gate", second: "up"})
        in_rows = view is not None
        if in_rows:   # the halves of a rows view: (B, S, N / 2)
            region.names[view], region.in_rows[view] = region.names[gemm], True
            region.nodes.append(view)
            region.whole.add(view)
            region.rows = (*_val(view).shape[:-1], shape[1])
        region.nodes += [split, first, second]
        region.transparent.update(n for n in (view, split, first, second) if n is not None)
        region.in_rows.update({split: in_rows, first: in_rows, second: in_rows})
        region.gated = True
    if gemm.target is aten.addmm.default:   # bias + A @ B: the bias is an operand added to accum
        bias = gemm.args[0]
        v = _val(bias)
        if not isinstance(bias, torch.fx.Node) or v is None or not _reads(v, shape) or gemm.kwargs:
            return region
        region.lines.append(f"    t0 = add(accum, {region.operand(bias)})")
        region.names[gemm] = "t0"
    frontier = [u for n in region.nodes for u in n.users if u not in region.nodes]
    ends: set = set()
    progress = True
    while progress:   # users join once every region input they read is in; order kept topological
        progress = False
        for node in list(frontier):
            if node in region.names or node.op != "call_function" or \
                    (node.target not in POINTWISE and node.target not in REDUCTIONS and node.target not in _VIEWS):
                frontier.remove(node)
                continue
            if region.gated and any(a in region.whole for a in node.all_input_nodes):
                frontier.remove(node)   # reads the whole result, which a gated epilogue has only as an output
                continue
            if any(a in ends for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)):
                frontier.remove(node)   # reads a reduction of this region: that would take another pass
                continue
            if any(isinstance(a, torch.fx.Node) and a in descendants and a not in region.names
                   for a in (*node.args, *node.kwargs.values())):
                continue   # waits for another region input
            v = _val(node)
            if not isinstance(v, torch.Tensor) or v.dtype not in (*_STORED, torch.bool):
                frontier.remove(node)
                continue
            frontier.remove(node)
            if node.target in _VIEWS:   # names its input's value in the other shape
                in_rows = _rows_view(node, region) if not node.kwargs else None
                if in_rows is None:
                    continue
                region.rows = region.rows or (tuple(v.shape) if in_rows else None)
                region.names[node], region.in_rows[node] = region.names[node.args[0]], in_rows
                region.nodes.append(node)
                region.transparent.add(node)
                frontier.extend(u for u in node.users if u not in frontier)
                progress = True
                continue
            spaces = {region.in_rows[a] for a in node.all_input_nodes if a in region.names}
            if len(spaces) != 1:   # values of accum's shape and of the rows view's: no one shape
                continue
            in_rows = spaces.pop()
            region.current = region.rows if in_rows else shape
            if node.target not in REDUCTIONS and tuple(v.shape) != region.current:
                continue
            saved = region.save()
            found = _expression(node, region, descendants)
            if found is None:
                region.restore(saved)
                continue
            text, end = found
            name = f"t{len(region.lines)}"
            region.lines.append(f"    {name} = {text}")
            region.names[node], region.in_rows[node] = name, in_rows
            region.nodes.append(node)
            progress = True
            if end:
                ends.add(node)
            else:
                frontier.extend(u for u in node.users if u not in frontier)
    return region


def _outputs(region: _Region) -> list:
    inside = set(region.nodes)
    return [n for n in region.nodes if any(u not in inside for u in n.users)]


# GEMM outputs smaller than this are left to Inductor on a GPU: an epifuse::gemm call costs
# about 130 us of host time where torch's addmm costs 12, and at 8192 x 64 the fused kernel ran
# 58 us against cuBLAS's 46 while the pass it saves moves 2 MB (H200, research/op_host.py and
# backend_probe; at 8192 x 1024 the two ran at parity)
MIN_FUSED_ELEMENTS = 1 << 22


def fuse_gemms(graph: torch.fx.Graph, report: Report | None = None, min_elements: int = 0, judge=None) -> Report:
    """Rewrite every fusible region of `graph` (in place) whose GEMM writes at least
    `min_elements` elements; returns what was fused and what not. `judge`, where given, is
    asked about each region before it is rewritten, as judge(GEMM's aten op, its input values,
    the fused call's arguments (fake values for tensors), accum's value, the operands' values,
    the outputs' values), and returns why the region should be left to Inductor, or None to
    fuse it (the backend's is epifuse.graph_payoff.slower, on a GPU)."""
    report = report if report is not None else Report()
    report.notes.extend(_unmerged_gates(graph))
    for gemm in [n for n in graph.nodes if _is_gemm(n)]:
        A, B = (gemm.args[1], gemm.args[2]) if gemm.target is aten.addmm.default else gemm.args[:2]
        va, vb, vout = _val(A), _val(B), _val(gemm)
        if va is None or vb is None or vout is None:
            report.skipped.append((gemm.name, "no shape information on its inputs"))
            continue
        if vout.numel() < min_elements:
            report.skipped.append((gemm.name, f"its {vout.numel()} output elements are fewer than {min_elements}: "
                                              "a fused call's host time would outweigh the pass it saves"))
            continue
        if not (va.dtype.is_floating_point and va.dtype in _STORED and va.dtype == vb.dtype):
            report.skipped.append((gemm.name, f"inputs {va.dtype} x {vb.dtype}: not a float GEMM epifuse runs"))
            continue
        region = _grow(gemm, tuple(vout.shape))
        if gemm.target is aten.addmm.default and region.names[gemm] == "accum":
            report.skipped.append((gemm.name, "an addmm whose bias is not an operand an epilogue reads, or that "
                                              "scales by beta or alpha"))
            continue
        if all(n is gemm or n in region.transparent for n in region.nodes):   # an addmm alone: cuBLAS adds its bias
            report.skipped.append((gemm.name, "no pointwise op or reduction consumes it"
                                   + (" beyond its bias" if gemm.target is aten.addmm.default else "")))
            continue
        outputs = _outputs(region)
        dtypes = []
        for out in outputs:
            v = _val(out)
            dtype = torch.int8 if v.dtype is torch.bool else v.dtype   # a mask: its 0/1 bytes
            dtypes.append(str(dtype).removeprefix("torch."))
        params = ", ".join(["accum", *region.operands.values()])
        out_names = [f"out{k}" for k in range(len(outputs))]
        lines = region.lines + [f"    {name} = {region.names[o]}" for name, o in zip(out_names, outputs)]
        source = (f"def fused_{gemm.name}({params}):\n" + "\n".join(lines)
                  + f"\n    return {', '.join(out_names)}\n")
        try:
            key = torch_ops.entry(torch_ops.register_epilogue(source)).key
            epilogue_table.time_heavy(key)
        except Exception as error:   # an epilogue the parser or binder refuses: left unfused, said why
            report.skipped.append((gemm.name, f"the epilogue it would get is refused: {error}"))
            continue
        compute = torch.float64 if va.dtype == torch.float64 else torch.float32
        precision = "highest" if va.dtype in (torch.float32, torch.float64) and \
            not torch.backends.cuda.matmul.allow_tf32 else "default"
        place = _first_user(region, outputs)
        if place is None:
            report.skipped.append((gemm.name, "an operand of its epilogue is computed after a value of the "
                                              "region is first used"))
            continue
        operand_values = [_operand_value(o, region) for o in region.operands]
        call_args = (key, va, vb, operand_values, [], "t" * len(operand_values), ",".join(dtypes), compute, False,
                     precision)
        if judge is not None:
            try:
                why = judge(gemm.target, [_val(a) for a in (gemm.args[:3] if gemm.target is aten.addmm.default
                                                             else gemm.args[:2])],
                            call_args, vout, operand_values, [_val(o) for o in outputs])
            except Exception as error:   # a fused call that fails here would fail in the graph too
                why = f"measuring the fused call failed: {type(error).__name__}: {error}"
            if why is not None:
                report.skipped.append((gemm.name, why))
                continue
        with graph.inserting_before(place):
            operand_nodes = [_operand_node(graph, o, region) for o in region.operands]
            call = graph.call_function(torch.ops.epifuse.gemm.default, (key, A, B, operand_nodes, *call_args[4:]))
            call.meta["val"] = _fake_outputs(call)
            items = []
            for k in range(len(outputs)):
                item = graph.call_function(operator.getitem, (call, k))
                item.meta["val"] = call.meta["val"][k]
                items.append(item)
        for out, item in zip(outputs, items):
            replacement = item
            if _val(out).dtype is torch.bool:   # a comparison stored as 0/1 bytes: converted back to bool
                with graph.inserting_after(replacement):
                    replacement = graph.call_function(prims.convert_element_type.default, (replacement, torch.bool))
                    replacement.meta["val"] = _val(out)
            if tuple(item.meta["val"].shape) != tuple(_val(out).shape):   # keepdim: the reduced dims back as 1s
                with graph.inserting_after(replacement):
                    replacement = graph.call_function(aten.view.default, (replacement, list(_val(out).shape)))
                    replacement.meta["val"] = _val(out)
            out.replace_all_uses_with(replacement)
        for node in [*reversed(region.nodes), *reversed(list(region.inlined))]:
            if not node.users:
                graph.erase_node(node)
        report.fused.append(Fused(source, gemm.name, [n.name for n in region.nodes]))
    return report


GATE_DEPTH = 8   # how many pointwise ops deep _unmerged_gates looks for where two GEMMs meet


def _pointwise_reach(node, depth: int = GATE_DEPTH) -> set:
    """The nodes that pointwise ops compute from `node`, at most `depth` ops deep."""
    seen, layer = set(), [node]
    for _ in range(depth):
        layer = [u for n in layer for u in n.users
                 if u not in seen and u.op == "call_function" and u.target in POINTWISE]
        seen.update(layer)
    return seen


def _unmerged_gates(graph) -> list:
    """(names, why) for each pair of `mm`s of one input with weights of one shape whose results
    meet in pointwise math (`silu(x @ Wg) * (x @ Wu)`): one gated GEMM would read x once, but
    only over one merged weight, and concatenating two weights copies both every step; a model
    that keeps them as one (a Linear to twice the features, chunked) gets the gated GEMM."""
    gemms = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.mm.default]
    found = []
    for k, a in enumerate(gemms):
        for b in gemms[k + 1:]:
            va, vb = _val(a.args[1]), _val(b.args[1])
            if a.args[0] is not b.args[0] or va is None or vb is None or tuple(va.shape) != tuple(vb.shape):
                continue
            if _pointwise_reach(a) & _pointwise_reach(b):
                found.append((f"{a.name} and {b.name}",
                              "their results meet in pointwise math over one input: one gated GEMM needs the two "
                              "weights merged, which would copy both every step; keep them as one weight (a Linear "
                              "to twice the features, its result chunked in two) to get it"))
    return found


def _first_user(region: _Region, outputs: list):
    """The first node (in graph order) that reads a region output from outside the region:
    the fused call goes before it, after every operand; None where an operand comes later."""
    inside = set(region.nodes)
    users = [u for o in outputs for u in o.users if u not in inside]
    order = {n: i for i, n in enumerate(region.gemm.graph.nodes)}
    last_input = max((order[n] for n in (*region.operands, *region.gemm.all_input_nodes)), default=0)
    first = min(users, key=lambda n: order[n])
    return first if order[first] > last_input else None


def _operand_value(node, region: _Region):
    """An operand's value as the fused call reads it: viewed to accum's rows (_row_operand),
    a bool as uint8."""
    value = _val(node)
    if node in region.operand_views:
        value = value.view(region.operand_views[node])
    return value.to(torch.uint8) if value.dtype is torch.bool else value


def _operand_node(graph, node, region: _Region):
    """The graph node the fused call reads for an operand (_operand_value's, in the graph)."""
    if node in region.operand_views:
        view = graph.call_function(aten.view.default, (node, list(region.operand_views[node])))
        view.meta["val"] = _val(node).view(region.operand_views[node])
        node = view
    return _as_bytes(graph, node) if _val(node).dtype is torch.bool else node


def _as_bytes(graph, node):
    """A bool operand as uint8 0 and 1 (the kernels load integer operands, not bool ones): a
    conversion, which Inductor fuses into the mask's producer or runs as one small pass; a
    bitcast view (aten.view.dtype) has no Inductor lowering from bool on CUDA."""
    converted = graph.call_function(prims.convert_element_type.default, (node, torch.uint8))
    converted.meta["val"] = _val(node).to(torch.uint8)
    return converted


def _fake_outputs(call):
    """The op's outputs as fake tensors, from its fake implementation under the graph's mode."""
    from torch._guards import detect_fake_mode
    args = call.args
    fakes = [_val(a) for a in (args[1], args[2], *args[3])]
    mode = detect_fake_mode(fakes)
    with mode:
        return torch.ops.epifuse.gemm.default(args[0], fakes[0], fakes[1], fakes[2:], list(args[4]), *args[5:])


__all__ = ["fuse_gemms", "Report", "Fused", "POINTWISE", "REDUCTIONS", "MIN_FUSED_ELEMENTS"]
