"""The epilogue table: every epilogue the custom ops run, registered once under an id and a key.

An op's `epilogue` argument is the epilogue's key (`Entry.key`): a header with a digest, then
the Program as JSON (printing.dump_program), compressed and base64-encoded, so the ops read the
same epilogue in any process. torch.compile bakes the argument into graphs it caches on disk (inductor's FX
graph and AOTAutograd caches); a later process that loads them has not traced the backward, so
it never registered the backward's epilogue, and a process-local number would name nothing, or
another epilogue. An unknown key is read back and registered.

A key read back is checked as the parser would check source (`read_key`): it may come from a
file on disk. `register_epilogue` also makes the variant that returns accum for the backward
(`save_accum`), and `_describe` gives torch.compile a constant per epilogue.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import keyword
import threading
import zlib
from dataclasses import dataclass
from typing import Callable

from .arguments import epilogue_program
from .errors import EpilogueArgumentError, UnsupportedError
from .frontend import IDENTIFIER, RESERVED_KEYWORDS
from .program import Expr, Program, Statement
from .ops import OPS
from .printing import FreshNames, dump_program, load_program


@dataclass(frozen=True)
class Entry:
    """A registered epilogue. `saves_accum`: its last output is accum itself, added by epifuse
    so the backward can read it (a gated epilogue's last two: the gate half, then the up half);
    callers see the first `visible` outputs."""

    program: Program
    saves_accum: bool
    visible: int
    user: Program
    key: str

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.program.outputs)

    @property
    def gated(self) -> bool:
        """`gate, up = accum.chunk(2, dim=-1)`: accum is the first half of B's columns, accum_up
        the second."""
        return "accum_up" in self.user.params

    @property
    def joins(self) -> str | None:
        """The output that is a cat of the gated halves (`D = cat((a, b), dim=-1)`), or None."""
        return next((s.target for s in self.user.statements
                     if s.expr.kind == "call" and OPS[s.expr.value].kind == "join"), None)

    @property
    def saved(self) -> int:
        """How many accumulators the last outputs save for the backward (0, 1, or 2 if gated)."""
        return (2 if self.gated else 1) if self.saves_accum else 0


_TABLE: list[Entry] = []
_IDS: dict[tuple, int] = {}
_KEYS: dict[str, int] = {}
_LOCK = threading.Lock()
_KEY_TAG = "epifuse-epilogue-2"


def _key_of(program: Program, save_accum: bool) -> str:
    """'<tag>:<0|1: saves accum>:<digest>:' then the program's JSON, compressed and in url-safe
    base64: letters, digits and '-_:=' only, since inductor writes string arguments into the
    Python source it generates without escaping them (a quote or a newline in the key was a
    SyntaxError there)."""
    text = dump_program(program)
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    body = base64.urlsafe_b64encode(zlib.compress(text.encode(), 9)).decode()
    return f"{_KEY_TAG}:{int(save_accum)}:{digest}:{body}"


def register_epilogue(epilogue: Callable | str | Program | None, save_accum: bool = False) -> int:
    """The id of `epilogue` (parsed once; the same epilogue always gets the same id).

    With `save_accum`, the id of a variant that also returns accum as its last output. An int
    is an id already: modules keep ids, which torch.compile treats as constants (a Program
    object would have to be reconstructed across graph breaks).
    """
    if isinstance(epilogue, int):
        epilogue = _TABLE[epilogue].user
    program = epilogue_program(epilogue)
    if program.updates:
        updates = program.updates
        raise UnsupportedError(
            f"The epilogue updates {', '.join(updates)} in place where a condition holds "
            f"(`{updates[0]} = where(cond, value, {updates[0]})`), and epifuse's custom ops, which autograd, "
            "torch.compile and DTensors go through, return new tensors instead of writing their inputs.",
            hint=f"Call epifuse.gemm outside torch.compile with no input requiring grad, or name the new value "
                 f"apart (`{updates[0]}_new = where(cond, value, {updates[0]})`) to get it as a new tensor.")
    key = (program, save_accum)
    eid = _IDS.get(key)
    if eid is not None:
        return eid
    visible = len(program.outputs)
    entry = Entry(_with_accum_output(program) if save_accum else program, save_accum, visible,
                  program, _key_of(program, save_accum))
    with _LOCK:
        if key not in _IDS:
            _TABLE.append(entry)
            _IDS[key] = len(_TABLE) - 1
            _KEYS[entry.key] = _IDS[key]
        return _IDS[key]


_TIME_HEAVY: set[str] = set()   # keys whose heavy epilogues are timed among a few kernels


def time_heavy(key: str) -> None:
    """Have calls of the epilogue `key` time a short list where the epilogue is heavy, rather
    than take the shipped table's first choice untimed (runtime/tune.choose's `time_heavy`):
    the compile backend's fused GEMMs, whose first call is part of a compilation anyway."""
    with _LOCK:
        _TIME_HEAVY.add(key)


def entry(eid: int) -> Entry:
    return _TABLE[eid]


def resolve(key: str) -> Entry:
    """The epilogue an op's `epilogue` argument names: registered in this process, or read
    from the key (a graph that torch.compile cached in another process)."""
    eid = _KEYS.get(key)
    if eid is not None:
        return _TABLE[eid]
    program, save_accum = read_key(key)
    try:
        eid = register_epilogue(program, save_accum)
    except RecursionError:   # hashing and printing a Program recurse once per level of nesting
        raise EpilogueArgumentError(
            "epifuse::gemm got an epilogue key whose expressions nest too deeply to register.",
            hint="Split the long expression into several assignments.") from None
    with _LOCK:
        _KEYS.setdefault(key, eid)   # the same program, whatever the JSON's spacing
    return _TABLE[eid]


# A key's JSON is at most this long once decompressed (a parsed epilogue's is far shorter), and
# its expressions nest at most this deep (the parser's nesting limit keeps a parsed one shallower).
_MAX_KEY_TEXT = 1 << 26
_MAX_KEY_DEPTH = 1000


def read_key(key: str) -> tuple[Program, bool]:
    """The program and save_accum flag an epilogue key spells; EpilogueArgumentError where it
    spells none, or a program the parser would refuse (_check_program)."""
    if not isinstance(key, str):
        raise EpilogueArgumentError(f"epifuse::gemm takes its epilogue as a key string, not a "
                                    f"{type(key).__name__}.")
    try:
        tag, save_accum, digest, body = key.split(":")
        inflate = zlib.decompressobj()
        data = inflate.decompress(base64.urlsafe_b64decode(body.encode("ascii")), _MAX_KEY_TEXT)
        if inflate.unconsumed_tail or not inflate.eof:
            raise ValueError("the compressed program is cut short or too long")
        text = data.decode()
        if tag != _KEY_TAG or save_accum not in ("0", "1") \
                or hashlib.sha256(text.encode()).hexdigest()[:32] != digest:
            raise ValueError("not an epilogue key, or its digest does not match")
        program = load_program(text)
        _check_program(program)
        return program, save_accum == "1"
    except (ValueError, zlib.error, UnicodeError) as exc:
        raise EpilogueArgumentError(
            f"epifuse::gemm got an epilogue argument it cannot read ({exc}): {key[:60]!r}...",
            hint="Pass an epilogue's key: torch_ops.entry(torch_ops.register_epilogue(epi)).key.") from None


def _check_program(program: Program) -> None:
    """ValueError unless `program` is one the parser could have produced: what frontend.parse
    checks on source, checked on the Program itself (load_program has checked each name's
    spelling, each op's name and arity and each parameter's kind). A key is read in another
    process, maybe from a file on disk, so nothing in it is taken on trust: an output returned
    twice, a name read before it is assigned or a parameter passed twice would otherwise reach
    the binder and the kernels."""
    if not (program.name.isidentifier() and not keyword.iskeyword(program.name)):
        raise ValueError(f"the function name {program.name!r} is not a Python name")
    if len(program.param_locs) != len(program.params):
        raise ValueError(f"{len(program.params)} parameters but {len(program.param_locs)} places")
    defined: set[str] = set()
    for name in program.params:
        _check_name(name, "parameter")
        _check_not_reserved(name, "parameter")
        if name in defined:
            raise ValueError(f"the parameter {name!r} is listed twice")
        defined.add(name)
    if "accum" not in defined:
        raise ValueError("accum is not a parameter")
    for statement in program.statements:
        _check_name(statement.target, "variable")
        _check_expr(statement.expr, defined)
        if statement.target in defined:
            raise ValueError(f"the variable {statement.target!r} is assigned twice")
        defined.add(statement.target)
    if not program.outputs:
        raise ValueError("the program returns nothing")
    returned: set[str] = set()
    for name, _ in program.outputs:
        if name not in defined:
            raise ValueError(f"the output {name!r} is never assigned")
        if name in returned:
            raise ValueError(f"the output {name!r} is returned twice")
        _check_not_reserved(name, "output")
        returned.add(name)


def _check_name(name: str, what: str) -> None:
    if not IDENTIFIER.match(name) or name.startswith("__"):
        raise ValueError(f"the {what} name {name!r} is not one an epilogue may use")


def _check_not_reserved(name: str, what: str) -> None:
    if name in RESERVED_KEYWORDS:
        raise ValueError(f"the {what} {name!r} has the name of an option")


def _check_expr(expr: Expr, defined: set) -> None:
    """Names assigned before they are read, float literals (the parser makes every number
    literal a float), each parameter once and never a bare int (only dims are ints, in a
    tuple), clamp with a bound, and no deeper nesting than a statement the parser accepts."""
    stack = [(expr, 1)]
    while stack:
        e, depth = stack.pop()
        if depth > _MAX_KEY_DEPTH:
            raise ValueError(f"an expression nests more than {_MAX_KEY_DEPTH} deep")
        if e.kind == "name":
            if e.value not in defined:
                raise ValueError(f"{e.value!r} is read before it is assigned")
        elif e.kind == "const":
            if type(e.value) is not float:
                raise ValueError(f"the literal {e.value!r} is not a float")
        else:
            keys = [k for k, _ in e.params]
            if len(set(keys)) != len(keys):
                raise ValueError(f"{e.value}() gets a parameter twice")
            if any(type(v) is int for _, v in e.params):
                raise ValueError(f"{e.value}() gets an int parameter where the parser writes a float")
            if e.value == "clamp" and not e.params:
                raise ValueError("clamp() has no bound")
            stack.extend((a, depth + 1) for a in e.args)


def _with_accum_output(program: Program) -> Program:
    """`program` that also returns accum (and a gated one's accum_up after it)."""
    names = FreshNames({*program.params, *(s.target for s in program.statements)})
    loc = program.outputs[-1][1]
    saved = [("saved_accum", "accum")] + ([("saved_up", "accum_up")] if "accum_up" in program.params else [])
    statements = tuple(Statement(names.fresh(prefix), Expr("name", leaf, loc=loc), loc) for prefix, leaf in saved)
    return dataclasses.replace(program, statements=program.statements + statements,
                               outputs=program.outputs + tuple((st.target, loc) for st in statements))


def _constant_for_compile(fn):
    """torch.compiler.assume_constant_result(fn) without importing torch._dynamo, which that
    function does first (1-2 s, most of `import epifuse`): the decorator only sets this attribute,
    which dynamo reads when it traces a call of fn. tests/unit/test_startup.py checks that the
    two still agree."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_for_compile
def _describe(epilogue, save_accum: bool) -> tuple:
    """(key, operand names, output names, visible count, gated, the output that is a cat of
    the gated halves or None): a constant for torch.compile, which runs this once while
    tracing instead of tracing the parser."""
    e = _TABLE[register_epilogue(epilogue, save_accum)]
    return e.key, e.program.operands, e.output_names, e.visible, e.gated, e.joins


__all__ = ["Entry", "register_epilogue", "time_heavy", "entry", "resolve", "read_key"]
