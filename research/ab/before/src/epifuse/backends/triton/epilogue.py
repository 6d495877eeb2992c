"""The epilogue as Triton source: lines over one (BLOCK_M, EPI_N) piece of a tile.

`emit_epilogue(graph, layout, style)` walks the Graph once and returns the lines (unindented)
and the names of the @jit helpers they call. The lines read the names every kernel template
defines before its epilogue hole: acc_e (the accumulator piece), rm, rn, mask_m, mask_n,
mask, pid_l, pid_m, pid_en, offs_m, offs_en (and batch, in the persistent kernel). Each op
lowers through its rule (rules.py); tile outputs are converted and stored (a cat of a gated
epilogue's halves as two stores, N columns apart), reductions are folded over the piece and
added atomically or stored as per-program partials (layout.py says which). A reduction whose
value later math reads (ir.fed_reductions, always over N) is folded over the piece's columns in
registers and broadcast back as a (BLOCK_M, 1) column: that is the whole row only where one
piece spans N (EPI_N == BLOCK_N >= N), which the kernel's support check
(families.in_tile_check) makes sure of before these lines run. Every variable is named here
(v0, r_y1, ...): nothing the user wrote is pasted in except numbers that were parsed as
numbers.
"""
from __future__ import annotations

from ... import ops
from ...errors import InternalError
from ...ir import ACCUM, ACCUM_IMAG, ACCUM_UP, AXES, CONST, INPUT, Graph, Node, conditional_stores, fed_reductions
from .gluon_api import gluon_api
from .layout import Layout, OperandParams, OutputParams
from .rules import LOG_OF_NORMAL, LogSum, _f, log_sum, rule_for

# The @jit helper that folds two partial results, by the reduction's combine (header.py.j2).
COMBINE_HELPERS = {"add": "_add", "maximum": "_max_nan", "minimum": "_min_nan",
                   "logsumexp": "_max_nan"}   # its max step; _logsumexp_lines does the rest


STYLES = ("pointer", "tma", "gluon")


def emit_epilogue(graph: Graph, layout: Layout, style: str = "pointer") -> tuple[list[str], set[str]]:
    """The epilogue's lines, unindented, over one (BLOCK_M, EPI_N) piece of the tile. They read
    acc_e, rm, rn, mask_m, mask_n, mask, pid_l, pid_m, pid_en, offs_m, offs_en, which the main
    loops define. `style` says how tiles move: "pointer" loads and stores; "tma" (the persistent
    kernel) also device-side descriptors, and batch; "gluon" (the warp-specialized Gluon kernel)
    stores tiles through shared memory and host descriptors (y*_smem, y*_desc), reads (M, N)
    operands its launch loads by TMA from shared memory (x*_smem), and makes tensors in the
    accumulator's layout (acc_layout)."""
    if style not in STYLES:
        raise InternalError(f"unknown epilogue style {style!r}")
    lines: list[str] = []
    helpers: set[str] = set()
    names: dict[int, str] = {}
    operand_prefix = {o.name: o for o in layout.operands}
    conditional, unread = conditional_stores(graph)
    fed = {id(node) for node in fed_reductions(graph)}
    if fed:
        lines.append('tl.static_assert(EPI_N == BLOCK_N, "a reduction that feeds later math needs the whole '
                     'tile in one piece")')
    for i, node in enumerate(graph.nodes()):
        var = f"v{i}"
        names[id(node)] = var
        if id(node) in unread:
            continue   # an operand updated in place only where a condition holds: never read
        if node.op is ACCUM:
            lines.append(f"{var} = acc_e.to(tl.float32)")
        elif node.op is ACCUM_IMAG or node.op is ACCUM_UP:   # the planar and gated templates' second
            lines.append(f"{var} = acc2_e.to(tl.float32)")
        elif node.op is CONST:
            names[id(node)] = _f(node.arg)
        elif node.op is INPUT:
            lines.extend(_load_operand(var, operand_prefix[node.arg.name], style))
        elif node.op.kind == "join":
            continue  # emitted by its output's store
        elif node.op.is_reduction:
            if id(node) in fed:
                lines.extend(_row_reduction(var, node, names, style))
            # else emitted by its output's store
        else:
            rule = rule_for(node)
            if rule is None:
                raise InternalError(f"no Triton rule for {node.op.name}; supports() should have said so")
            helpers.update(rule.helpers)
            srcs = [_coerce(names[id(s.src[0])], s.src[0], s, 0) if k in rule.through else _coerce(names[id(s)], s, node, k)
                    for k, s in enumerate(node.src)]
            lines.append(f"{var} = {rule.emit(*srcs, **node.params)}")
    for y, out in zip(layout.outputs, graph.outputs):
        if out.name in conditional:
            cond, value, when = conditional[out.name]
            lines.extend(_store_where(y, names[id(cond)], cond, names[id(value)], value, when, style))
        elif out.node.op.kind == "join":
            lines.extend(_store_halves(y, [(names[id(s)], s) for s in out.node.src], style))
        elif y.reduce is None:
            lines.extend(_store_tile(y, names[id(out.node)], out.node, style))
        else:
            source = out.node.src[0]
            logs = log_sum(source) if y.reduce.reduction.combine == "add" and "N" in y.dims else None
            lines.extend(_store_reduction(y, names, source, style, logs, helpers))
    return lines, helpers


def _coerce(expr: str, src: Node, user: Node, position: int) -> str:
    """Bools where conditions are expected, floats everywhere else."""
    wants_bool = user.op.kind == "logical" or (user.op is ops.where and position == 0)
    if wants_bool and src.dtype == "float":
        return f"({expr} != 0)"
    if not wants_bool and src.dtype == "bool":
        return f"{expr}.to(tl.float32)"
    return expr


def _offset(prefix: str, axes) -> str:
    index = {"L": "pid_l", "M": "rm[:, None]", "N": "rn[None, :]"}
    terms = [f"{index[a]} * {prefix}_s{a.lower()}" for a in AXES if a in axes]
    return " + ".join(terms) if terms else "0"


def _mask_of(axes) -> str | None:
    if "M" in axes and "N" in axes:
        return "mask"
    if "M" in axes:
        return "mask_m[:, None]"
    if "N" in axes:
        return "mask_n[None, :]"
    return None


def _load_operand(var: str, o: OperandParams, style: str) -> list[str]:
    if o.kind == "number":
        return [f"{var} = {o.prefix}"]
    mask = _mask_of(o.axes)
    masked = f", mask={mask}, other=0.0" if mask else ""
    pointer_load = f"{var} = _to_f32(tl.load({o.prefix}_ptr + {_offset(o.prefix, o.axes)}{masked}))"
    if style == "pointer" or not {"M", "N"} <= set(o.axes):
        return [pointer_load]
    flag = f"{o.prefix.upper()}_TMA"
    if style == "gluon":  # loaded into shared memory when the tile started; waited for
        return [f"if {flag}:",
                f"    {var} = {o.prefix}_smem.load(acc_layout).to(tl.float32)",
                "else:",
                f"    {pointer_load}"]
    return [f"if {flag} == 2:",
            f"    {var} = _to_f32({o.prefix}_desc.load([offs_m, offs_en]))",
            f"elif {flag} == 3:",
            f"    {var} = _to_f32({o.prefix}_desc.load([batch, offs_m, offs_en]).reshape(BLOCK_M, EPI_N))",
            "else:",
            f"    {pointer_load}"]


def _store_where(y: OutputParams, cond_expr: str, cond: Node, expr: str, node: Node, when: bool,
                 style: str) -> list[str]:
    """A conditional store: `expr` written where the condition is `when`, every other element
    of the output neither read nor written (a pointer store under the mask, in every style)."""
    value = _stored_value(y, expr, node, style)
    selected = f"({_as_full_tile(cond_expr, cond, style)} {'!=' if when else '=='} 0.0)"
    return [f"tl.store({y.prefix}_ptr + {_offset(y.prefix, y.axes)}, {value}, mask=mask & {selected})"]


def _as_full_tile(expr: str, node: Node, style: str) -> str:
    """`expr` broadcast to the (BLOCK_M, EPI_N) piece by adding -0.0, the addition that changes
    no value (+0.0 would turn -0.0 into +0.0). The -0.0 is made as -1.0 * 0.0: Triton 3.6 makes
    a full() of any zero +0.0."""
    if node.dtype == "bool":
        expr = f"{expr}.to(tl.float32)"
    if {"M", "N"} <= set(node.axes):
        return expr
    if style == "gluon":  # Gluon makes tensors only with an explicit layout
        return f"({expr} + gl.full((BLOCK_M, EPI_N), -1.0, gl.float32, acc_layout) * 0.0)"
    return f"({expr} + tl.full((BLOCK_M, EPI_N), -1.0, tl.float32) * 0.0)"


def _stored_value(y: OutputParams, expr: str, node: Node, style: str) -> str:
    """`expr` as a full piece converted to output y's dtype (rounding and saturation)."""
    upper = y.prefix.upper()
    return (f"_convert({_as_full_tile(expr, node, style)}, {upper}_KIND, {upper}_LO, {upper}_HI, "
            f"{y.prefix}_ptr.dtype.element_ty)")


def _store_tile(y: OutputParams, expr: str, node: Node, style: str) -> list[str]:
    upper = y.prefix.upper()
    value = _stored_value(y, expr, node, style)
    pointer_store = f"tl.store({y.prefix}_ptr + {_offset(y.prefix, y.axes)}, {value}, mask=mask)"
    flag = f"{y.prefix.upper()}_TMA"
    if style == "gluon":  # the previous tile's TMA stores were waited for before the epilogue
        api = gluon_api()
        return [f"if {flag}:",
                f"    if {upper}_WAIT:  # an earlier output of this tile stores from the same buffer",
                "        tma.store_wait(pendings=0)",
                f"    {y.prefix}_smem.store({value})",
                "    fence_async_shared()",
                f"    {api.store}({y.prefix}_desc, [offs_m, offs_en], {y.prefix}_smem)",
                "else:",
                f"    {pointer_store}"]
    if style != "tma":
        return [pointer_store]
    return [f"if {flag} == 2:",
            f"    {y.prefix}_desc.store([offs_m, offs_en], {value})",
            f"elif {flag} == 3:",
            f"    {y.prefix}_desc.store([batch, offs_m, offs_en], {value}.reshape(1, BLOCK_M, EPI_N))",
            "else:",
            f"    {pointer_store}"]


def _store_halves(y: OutputParams, pieces: list, style: str) -> list[str]:
    """The store of `cat((a, b), dim=-1)` over a gated epilogue's halves: the output is twice
    the tile's width N (the kernel's N is a half's), a's piece at its columns rn and b's at
    rn + N, both under the tile's mask."""
    if style != "pointer":
        raise InternalError("a join (cat of a gated epilogue's halves) is stored by the gated pointer kernel only")
    offset = _offset(y.prefix, y.axes)
    return [f"tl.store({y.prefix}_ptr + {offset}{shift}, {_stored_value(y, expr, node, style)}, mask=mask)"
            for shift, (expr, node) in zip(("", f" + N * {y.prefix}_sn"), pieces)]


def _log_of_products(p: str, names: dict, logs: LogSum, style: str, helpers: set) -> list[str]:
    """Lines leaving in `p` the (BLOCK_M,) row sums of log(y) over the tile's columns, taken as
    logs of products of logs.group columns (fewer where the piece is narrow): the columns are
    halved and the halves multiplied (c times c + EPI_N / 2, ...) while the halves are at least
    8 wide, which pairs values one thread holds. Shifted: the products of y - 1 terms (log1p's
    argument itself), as (1 + a)(1 + b) - 1 (rules.LogSum). Adds the helpers the lines call to
    `helpers`."""
    y = _as_full_tile(names[id(logs.arg)], logs.arg, style)
    if not logs.shifted:
        lines = [f"{p} = tl.where(mask, {y}, 1.0)"]
    else:
        lines = [f"{p} = tl.where(mask, {y}, 0.0)" if logs.plus_one else f"{p} = tl.where(mask, {y} - 1.0, 0.0)"]
    combine = f"{p}_0 * {p}_1 + ({p}_0 + {p}_1)" if logs.shifted else f"{p}_0 * {p}_1"
    group = 1
    while group < logs.group:
        group *= 2
        # in thread: the wgmma and mma layouts give a thread 2 neighbouring columns of every 8
        lines.append(f"if EPI_N // {group} >= 8:")
        shape = f"BLOCK_M, 2, EPI_N // {group}"
        if style == "gluon":
            lines.append(f"    {p}_0, {p}_1 = gl.split({p}.reshape([{shape}]).permute((0, 2, 1)))")
        else:
            lines.append(f"    {p}_0, {p}_1 = tl.split(tl.permute(tl.reshape({p}, ({shape})), (0, 2, 1)))")
        lines.append(f"    {p} = {combine}")
    log = f"_log1p_of_excess({p})" if logs.shifted else LOG_OF_NORMAL.emit(p)
    helpers.update(("_log1p_of_excess",) if logs.shifted else LOG_OF_NORMAL.helpers)
    lines.append(f"{p} = tl.reduce({log}, 1, _add)")
    return lines


def _row_reduction(var: str, node: Node, names: dict, style: str) -> list[str]:
    """Lines leaving in `var` the (BLOCK_M, 1) reduction of `node`'s input over the piece's
    columns, the whole row where the piece spans N. Masked columns count as the reduction's
    identity (-inf for max and logsumexp, +inf for min, 0 for sums and amax); NaN propagates as
    in the partials (_max_nan, _min_nan); a mean divides the sum by N."""
    reduction = node.reduction
    source = node.src[0]
    tile = _as_full_tile(names[id(source)], source, style)
    r = f"{var}_row"
    if reduction.combine == "logsumexp":
        lines = _logsumexp_lines(r, tile, ("N",))
    else:
        if reduction.magnitude:
            tile = f"tl.abs({tile})"
        lines = [f"{r} = tl.where(mask, {tile}, {_f(reduction.identity)})",
                 f"{r} = tl.reduce({r}, 1, {COMBINE_HELPERS[reduction.combine]})"]
        if reduction.mean:
            lines.append(f"{r} = {r} / (N * 1.0)")
    return lines + [f"{var} = {r}[:, None]"]


def _logsumexp_lines(r: str, tile: str, dims) -> list[str]:
    """Lines leaving in `r` the log-sum-exp of `tile` over its in-tile `dims` (masked elements
    count as -inf): m = the max (NaN if any element is), then m + log(sum(exp(x - m))), where
    the shift is 0 for an infinite m (all -inf: the sum is 0 and the result -inf; +inf: the sum
    and the result are inf). The partials of the tiles fold by a log-sum-exp of theirs
    (registry._FOLDS)."""
    lines = [f"{r}_x = tl.where(mask, {tile}, {_f(float('-inf'))})", f"{r}_m = {r}_x"]
    axes = [axis for axis, name in ((1, "N"), (0, "M")) if name in dims]
    for axis in axes:
        lines.append(f"{r}_m = tl.reduce({r}_m, {axis}, _max_nan)")
    lines.append(f"{r}_shift = tl.where(tl.abs({r}_m) == _INF, 0.0, {r}_m)")
    spread = {("N",): "[:, None]", ("M",): "[None, :]"}.get(tuple(a for a in ("N", "M") if a in dims), "")
    lines.append(f"{r}_e = tl.exp({r}_x - {r}_shift{spread})")
    for axis in axes:
        lines.append(f"{r}_e = tl.reduce({r}_e, {axis}, _add)")
    lines.append(f"{r} = {r}_shift + tl.log({r}_e)")
    return lines


def _store_reduction(y: OutputParams, names: dict, node: Node, style: str,
                     logs: LogSum | None, helpers: set) -> list[str]:
    """Reduce the tile over its in-tile dims; fold it in atomically or store it as a partial.
    `logs`: the summand's log term, summed as logs of products (rules.LogSum; y.dims has N)."""
    r = f"r_{y.prefix}"
    reduction = y.reduce.reduction
    combine = COMBINE_HELPERS[reduction.combine]

    def reduce_call(v, axis):
        return f"tl.reduce({v}, {axis}, {combine})"

    lines = []
    summed = node if logs is None else logs.rest
    if reduction.combine == "logsumexp":
        lines.extend(_logsumexp_lines(r, _as_full_tile(names[id(node)], node, style), y.dims))
    elif summed is not None:
        tile = _as_full_tile(names[id(summed)], summed, style)
        if reduction.magnitude:
            tile = f"tl.abs({tile})"
        lines.append(f"{r} = tl.where(mask, {tile}, {_f(reduction.identity)})")
        if "N" in y.dims:
            lines.append(f"{r} = {reduce_call(r, 1)}")   # (BLOCK_M,), or a scalar after the next line
            if "M" in y.dims:
                lines.append(f"{r} = {reduce_call(r, 0)}")
        elif "M" in y.dims:
            lines.append(f"{r} = {reduce_call(r, 0)}")   # (BLOCK_N,)
    if logs is not None:
        lines.extend(_log_of_products(f"{r}_log", names, logs, style, helpers))
        if "M" in y.dims:
            lines.append(f"{r}_log = {reduce_call(f'{r}_log', 0)}")
        elif style == "gluon":
            lines.append(f"{r}_log = gl.convert_layout({r}_log, gl.SliceLayout(1, acc_layout))")
        sign = "+" if logs.sign > 0 else "-"
        lines.append(f"{r} = {r} {sign} {r}_log" if summed is not None
                     else f"{r} = {r}_log" if logs.sign > 0 else f"{r} = {r}_log * -1.0")
    kept = tuple(a for a in ("M", "N") if a not in y.dims)
    both = kept == ("M", "N")
    index = {"L": "pid_l", "M": "rm[:, None]" if both else "rm", "N": "rn[None, :]" if both else "rn"}
    mask = {("M",): ", mask=mask_m", ("N",): ", mask=mask_n", ("M", "N"): ", mask=mask"}.get(kept, "")
    if y.mode == "atomic":
        if y.scaled:
            lines.append(f"{r} = {r} * {y.prefix}_scale")
        terms = [f"{index[a]} * {y.prefix}_s{a.lower()}" for a in y.axes]
        address = f"{y.prefix}_ptr + {' + '.join(terms) or '0'}"
        # relaxed: nothing in the kernel reads the result back, and acq_rel costs each atomic a
        # GPU-wide fence and an L1 invalidation
        if reduction.magnitude:  # see reduction_mode
            lines.append(f"tl.atomic_max(({address}).to(tl.pointer_type(tl.int32)), "
                         f"{r}.to(tl.int32, bitcast=True) & 0x7FFFFFFF{mask}, sem='relaxed')")
        else:
            lines.append(f"tl.atomic_add({address}, {r}{mask}, sem='relaxed')")
    else:
        index.update({a: {"M": "pid_m", "N": "pid_en"}[a] for a in ("M", "N") if a in y.dims})
        terms = [f"{index[a]} * {y.prefix}_s{a.lower()}" for a in AXES]
        lines.append(f"tl.store({y.prefix}_ptr + {' + '.join(terms)}, {r}{mask})")
    return lines
