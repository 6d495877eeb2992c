"""Pick the kernel that runs a problem, by the tuning policy EPIFUSE_TUNE names:

  fast (default)  a choice remembered on disk from an earlier tuning; else the first kernel of
                  the shipped table of tuned choices for this GPU model and the nearest shape
                  (runtime/shipped.py), untimed: one compile; else SHORT_LIST kernels are timed
                  and the winner remembered: the table's choices at its other shapes, nearest
                  first, or on a GPU without a table the first of the untimed order. A
                  problem with K = 0 (an epilogue pass without a main loop, as a backward's)
                  near no entry takes the untimed order's first, untimed: the table's GEMM
                  choices say nothing of it, and on an H200 (2026-11-29, the FusedLinear MLP's
                  GELU backward at 1024, 4096 and 16384 tokens) the short list's winner was the
                  untimed first each time, at 0.945, 1.00 and 1.00 of full tuning's. The
                  compile backend's fused GEMMs (choose's `time_heavy`) whose epilogue moves
                  HEAVY_BYTES or more per output element time HEAVY_SHORT_LIST kernels of the
                  table's ranking instead of taking its first, which was ranked over light ones.
  full            every supported kernel is timed (today's tuning before fast existed), and the
                  winner remembered; fast and background then take it.
  background      fast's choice serves at once, while a worker thread times every kernel on
                  fresh tensors with the inputs' sizes, strides and dtypes (random values, made
                  when the worker reaches the problem; the queue holds only their description,
                  never the caller's tensors); when it is done the winner is remembered and
                  serves the next call (the kept launches and choices are dropped, and
                  generation() changes first). A problem whose tuning fails keeps fast's choice
                  and is not queued again. Its timings share the GPU with the caller's work, so
                  they are noisier than full's. Do not start capturing a CUDA graph while it
                  runs: the worker synchronizes and allocates, which makes a capture in another
                  thread fail; call wait_for_background() first.
  0               the first supported kernel of the untimed order, untimed.
While the current stream captures a CUDA graph nothing is timed under any policy (timing
synchronizes): a remembered choice, else the shipped table's first, else the untimed order's.

Timing (`_time_all`) runs every kernel on scratch outputs (so tuning never touches the user's
tensors, and `accumulate=True` or in-place outputs stay correct). Choices are kept in memory and
in <cache>/tuning.json, keyed by the graph's canonical hash, a power-of-two bucket of the
shape, the dtypes, the GPU, the library versions, the ranking rule and the set of candidates
timed (a short list's winner under a key of its own, so that full tuning is not answered by
it). The winner is the fastest, or within LIGHTER_WITHIN of it the kernel whose tiles (as it
runs them, and only tiles that fill the GPU's SMs) read the fewest operand bytes per output, a
Gluon kernel first among those as light. The file is rewritten atomically, under the cache's
lock of the entry "tuning" so that processes tuning at once keep each other's choices. A file
that is not what epifuse writes (unreadable, binary, truncated, not a flat JSON object of
strings, nested, larger than MAX_TUNING_BYTES) is set aside with a warning (cache.set_aside)
and tuning goes on as if there were none. Under Triton's interpreter the first supported
kernel is taken untimed.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import threading
from typing import NamedTuple

import torch

from ..arguments import EpilogueArguments, GemmArguments
from ..errors import EpilogueArgumentError
from ..backends.triton.device import capturing, gpu_sms, output_tiles
from ..shapes import bytes_per_output, operand_layouts
from ..version import __version__
from . import ahead, shipped
from .cache import cache_dir, entry_lock, read_file, set_aside, write_atomically
from .triton_identity import triton_version
from .compiled import start_thread

_LOCK = threading.Lock()
_MEMORY: dict[str, str] = {}
HISTORY: list[dict] = []  # every tuning done in this process: key, choice, timings (for reports)


def _bucket(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def shape_bucket(args) -> str:
    return f"L{_bucket(args.L)} M{_bucket(args.M)} N{_bucket(args.N)} K{_bucket(args.K)}"


def tuning_key(args) -> str:
    device = args.A.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    outputs = ",".join(f"{n}:{t.dtype}" for n, t in args.outputs.items())
    layouts = ",".join(f"{n}:{''.join('1' if bit else '0' for bit in cls)}" for n, cls in operand_layouts(args))
    return "|".join([
        args.key, shape_bucket(args), f"operands {layouts}",
        f"{args.A.dtype}x{args.B.dtype}", outputs, f"{args.precision} det={args.deterministic}",
        gpu, f"torch {torch.__version__}", f"triton {triton_version()}", f"epifuse {__version__}",
        f"ranking {RANKING}"])


def do_bench(fn, **kwargs) -> float:
    """Triton's do_bench (imported on first use: Triton is not loaded with epifuse)."""
    from triton.testing import do_bench as triton_do_bench
    return triton_do_bench(fn, **kwargs)


def candidates_digest(kernels) -> str:
    """Which kernels were timed: a winner remembered from another candidate set (before a new
    kernel class or config existed) is not taken for this one."""
    names = "\n".join(sorted(repr(k) for k in kernels))
    return "candidates " + hashlib.sha256(names.encode()).hexdigest()[:12]


MAX_TUNING_BYTES = 32 << 20  # some 70,000 choices; a store that would pass it starts afresh
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _path():
    return cache_dir().parent / "tuning.json"


def _parse(data: bytes) -> tuple[dict, str | None]:
    """The choices a tuning file holding `data` records, and what is wrong with it (None where
    nothing is). epifuse writes one flat JSON object of strings, so outside its strings the
    text has one pair of braces and no brackets: checked before json parses it, since json
    recurses once for each level of nesting (RecursionError, or a crash on a small stack)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return {}, "is not UTF-8 text"
    try:
        if _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)) != "{}":
            return {}, "is not one flat JSON object (truncated, nested or not JSON)"
        choices = json.loads(text)
    except (ValueError, RecursionError, MemoryError) as error:
        return {}, f"is not valid JSON ({type(error).__name__}: {str(error)[:80]})"
    if not isinstance(choices, dict) or not all(isinstance(v, str) for v in choices.values()):
        return {}, "is not a JSON object of strings"
    return choices, None


def _load() -> dict:
    """The choices remembered on disk; none where the file is missing or damaged (set aside)."""
    path = _path()
    found = read_file(path, MAX_TUNING_BYTES)
    if found is None:
        return {}
    data, seen = found
    choices, problem = _parse(data)
    if problem is not None:
        set_aside(path, problem, seen)
    return choices


def _store(key: str, choice: str) -> None:
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with entry_lock(path.parent, "tuning"):  # another process's choice stored meanwhile is kept
            data = _load()
            data[key] = choice
            text = json.dumps(data, indent=0, sort_keys=True)
            if len(text.encode()) > MAX_TUNING_BYTES:
                text = json.dumps({key: choice}, indent=0)
            write_atomically(path, text)
    except OSError:
        pass  # a read-only cache only costs a re-tune next time


def _scratch_args(args):
    """The same problem writing into fresh outputs (an operand updated in place, D = where(...),
    is its output's fresh tensor too)."""
    epi = args.epilogue
    outputs = {name: torch.empty_like(t) for name, t in epi.outputs.items()}
    scratch = EpilogueArguments(epi.program, accumulate=False, deterministic=epi.deterministic,
                                compute_dtype=epi.compute_dtype, **{**epi.operands, **outputs})
    return GemmArguments(args.A, args.B_given, epilogue=scratch, accumulator_type=args.accumulator_type,
                         precision=args.precision, A_imag=args.A_imag, B_imag=args.B_imag)


POLICIES = ("fast", "full", "background", "0")
SHORT_LIST = 3  # kernels fast times where no shipped choice is near: about one compile each


def policy() -> str:
    """The tuning policy EPIFUSE_TUNE names (unset or empty: fast)."""
    raw = os.environ.get("EPIFUSE_TUNE", "")
    value = raw.strip().lower() or "fast"
    if value not in POLICIES:
        raise EpilogueArgumentError(
            f"EPIFUSE_TUNE={raw!r} is not a tuning policy; it takes one of: fast (the default), full, "
            "background, 0.",
            hint="fast: a shipped or remembered choice, else a short timing; full: time every kernel; "
                 "background: serve fast's choice and time every kernel in a worker thread; 0: never time.")
    return value


def _on_gpu(args) -> bool:
    return args.A.device.type == "cuda"


def _gpu_name(args) -> str:
    return torch.cuda.get_device_name(args.A.device)


def _remembered(key: str):
    """The choice remembered for `key`, in this process or on disk (None if none)."""
    with _LOCK:
        if key not in _MEMORY:
            found = _load().get(key)
            if found is not None:
                _MEMORY[key] = found
        return _MEMORY.get(key)


def _remember(key: str, kernel) -> None:
    with _LOCK:
        _MEMORY[key] = repr(kernel)
    _store(key, repr(kernel))


HEAVY_BYTES = 4.0     # epilogue bytes per output element from which a heavy epilogue is timed
HEAVY_SHORT_LIST = 4  # kernels of distinct families and tiles timed for a heavy epilogue


def epilogue_bytes(args) -> float:
    """The bytes the epilogue reads and writes per output element: its tensor operands and
    outputs, each weighted by its size over the output's (a bias row counts next to nothing)."""
    tensors = [t for t in (*args.epilogue.operands.values(), *args.epilogue.outputs.values())
               if isinstance(t, torch.Tensor)]
    return bytes_per_output(tensors, args.L * args.M * args.N)


def _epilogue_pieces(kernel) -> int:
    """How many column pieces `kernel`'s epilogue runs in, from its repr ("..., epilogue in 4>")."""
    found = re.search(r"epilogue in (\d+)", repr(kernel))
    return int(found.group(1)) if found else 1


def _kind(kernel) -> tuple:
    """A kernel's family and tile shape, from its repr ("<family MxNxK ...>")."""
    return tuple(repr(kernel).strip("<>").split()[:2])


def distinct_tiles(order: list, count: int, kernels: list = ()) -> list:
    """One kernel of each family and tile shape in `order`, in the order of each kind's first
    kernel there, up to `count`: a ranking made over light epilogues, spread so that a heavy one
    finds the smaller or the register-lighter tile among them. Of a kind's kernels in `order` or
    `kernels` (the candidates the ranking may leave out), the one whose epilogue runs in the most
    pieces (fewest registers live at once; ties: the best ranked): heavy epilogues spilled in
    fewer."""
    kinds: dict = {}
    for kernel in order:
        kinds.setdefault(_kind(kernel), kernel)
    for kernel in [*order, *kernels]:
        kind = _kind(kernel)
        if kind in kinds and _epilogue_pieces(kernel) > _epilogue_pieces(kinds[kind]):
            kinds[kind] = kernel
    return list(kinds.values())[:count]


def _tile_area(kernel) -> int:
    """BLOCK_M x BLOCK_N of a kernel, from its repr's tile ("128x256x64")."""
    m, n = _kind(kernel)[1].split("x")[:2]
    return int(m) * int(n)


def smallest_ping_pong(kernels: list):
    """The ping-pong kernel of the smallest tile in `kernels` (the first of it), or None. A heavy
    epilogue times it beside distinct_tiles' four: each consumer holds the epilogue unrolled over
    its tile, and a math-heavy one overflowed the instruction cache at 128 x 128 (an H200,
    16384 x 4096 x 1024: a BCE loss with fp32 targets ran 1017 us there, 337 at 64 x 128, 395
    in the best of the four)."""
    ping_pong = [k for k in kernels if _kind(k)[0] == "gluon_pingpong"]
    return min(ping_pong, key=_tile_area, default=None)


def choose(args, kernels: list, time_heavy: bool = False):
    """The kernel to run `args` of `kernels` (all supporting args, best first in the untimed
    order), by the tuning policy. `time_heavy` (the compile backend's fused GEMMs): under fast,
    an epilogue moving HEAVY_BYTES or more per output element times HEAVY_SHORT_LIST kernels of
    the shipped ranking (distinct_tiles) and the smallest ping-pong (smallest_ping_pong) instead
    of taking the ranking's first, which was ranked over light epilogues (measured on an H200,
    16384 x 4096 x 1024: a BCE loss reading fp32 targets ran 1019 us in the table's first choice
    and 410 us in the best of the four; bias + GELU writing two bf16 outputs 489 against 294)."""
    chosen, timed = _decide(args, kernels, time_heavy)
    if chosen is not None:
        return chosen
    candidates, key, mode = timed
    if mode == "background":
        tune_in_background(args, candidates, key)
        return chosen_meanwhile(args, candidates)
    return _tune(args, candidates, key, mode)


def to_compile(args, kernels: list, time_heavy: bool = False) -> list:
    """The kernels a call of `args` would compile now, decided as `choose` decides but without
    timing or queuing anything: the one it takes, or those it would time (compiling ahead,
    runtime/ahead.py; background tuning's are not among them, the worker compiles those)."""
    chosen, timed = _decide(args, kernels, time_heavy)
    if chosen is not None:
        return [chosen]
    candidates, _, mode = timed
    return [chosen_meanwhile(args, candidates)] if mode == "background" else list(candidates)


def _decide(args, kernels: list, time_heavy: bool):
    """(the kernel, None) where the policy takes one untimed, else (None, (the kernels to time,
    the key to remember the winner under, the mode: "full", "fast" or "background"))."""
    mode = policy()
    generated = [k for k in kernels if k.name != "reference"]
    if len(generated) <= 1 or mode == "0" or not _on_gpu(args):
        return kernels[0], None
    key = f"{tuning_key(args)}|{candidates_digest(generated)}"
    by_name = {repr(k): k for k in generated}
    tuned = by_name.get(_remembered(key))
    if tuned is not None:
        return tuned, None
    order = shipped.ranked(args, generated, _gpu_name(args))
    if capturing(args.A.device):   # timing synchronizes, which a CUDA graph capture does not allow
        return (order[0] if order else generated[0]), None
    if mode == "full":
        return None, (generated, key, "full")
    if mode == "background" and args.form == "real":   # the worker rebuilds real GEMMs only: two-accumulator ones time now
        return None, (generated, key, "background")
    if order and len(order) > 1 and epilogue_bytes(args) >= HEAVY_BYTES:
        heavy = distinct_tiles(order, HEAVY_SHORT_LIST, generated)
        smallest = smallest_ping_pong(generated)
        if smallest is not None and _kind(smallest) not in {_kind(k) for k in heavy}:
            heavy.append(smallest)
        heavy_key = f"{key}|heavy {candidates_digest(heavy)}"
        remembered = by_name.get(_remembered(heavy_key))   # timed by an earlier process too
        if remembered is not None:
            return remembered, None
        if time_heavy:
            return None, (heavy, heavy_key, "fast")
    if order:
        return order[0], None
    if args.K == 0:   # the epilogue alone, no main loop: the table's GEMM choices say nothing of it
        return generated[0], None
    short = shipped.short_list(args, generated, _gpu_name(args), SHORT_LIST) or generated[:SHORT_LIST]
    short_key = f"{key}|short {candidates_digest(short)}"
    remembered = by_name.get(_remembered(short_key))
    return (remembered, None) if remembered is not None else (None, (short, short_key, "fast"))


def chosen_meanwhile(args, candidates: list):
    """What background tuning serves until its winner lands: the shipped table's first choice,
    else the untimed order's."""
    order = shipped.ranked(args, candidates, _gpu_name(args))
    return order[0] if order else candidates[0]


def _tune(args, kernels, key: str, mode: str):
    on_gpu = args.A.device.type == "cuda"   # do_bench's events time the current device's stream
    with torch.cuda.device(args.A.device) if on_gpu else contextlib.nullcontext():
        best = _time_all(args, kernels, mode)
    _remember(key, best)
    return best


# -- background tuning: one worker thread, one problem at a time ----------------------------------
class _Layout(NamedTuple):
    """What the worker needs of one of the caller's tensors to time a kernel as it runs on it."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


class _Problem(NamedTuple):
    """A problem queued for background tuning: the program, the options, each tensor's layout
    and each number operand; no tensor of the caller's."""
    program: object
    A: _Layout
    B: _Layout
    operands: dict   # name -> _Layout, or the number itself
    outputs: dict    # name -> _Layout
    deterministic: bool
    compute_dtype: torch.dtype | None
    accumulator_type: torch.dtype
    precision: str


_PENDING: dict = {}   # key -> (_Problem, kernels), in the order queued
_FAILED: set = set()  # keys whose background tuning raised: not queued again in this process
_WORKER: list = []    # the running worker thread, if any
_GENERATION = 0       # background winners remembered so far (generation())
LISTENERS: list = []  # called (no arguments) when a background winner is remembered: the
                      # modules that keep choices (select's, the kept launches) drop them


def generation() -> int:
    """How many background tunings have remembered a winner in this process. It changes
    before LISTENERS are called, so a choice made while it stayed the same may be kept, and one
    made across a change (the listeners may have dropped the kept choices meanwhile) may not."""
    with _LOCK:
        return _GENERATION


def _described(args) -> _Problem:
    """The problem `args` poses, as background tuning queues it: layouts and numbers only."""
    def layout(t):
        return _Layout(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
    epi = args.epilogue
    return _Problem(epi.program, layout(args.A), layout(args.B),
                   {n: layout(v) if isinstance(v, torch.Tensor) else v for n, v in epi.operands.items()},
                   {n: layout(t) for n, t in epi.outputs.items()},
                   epi.deterministic, epi.compute_dtype, args.accumulator_type, args.precision)


def tune_in_background(args, kernels, key: str) -> None:
    """Queue `args` for full tuning in the worker thread. Only its description is queued (the
    layouts of its tensors, its numbers and options): the worker times the kernels on fresh
    tensors of the same sizes, strides and dtypes filled with random values, made when it
    reaches the problem, so the caller's tensors are neither held nor read. A problem whose
    background tuning failed is not queued again. Not while the current stream captures a CUDA
    graph: the worker would synchronize and allocate during the capture, which fails it; fast's
    choice then serves until a later call queues it."""
    if torch.cuda.is_current_stream_capturing():
        return
    problem = _described(args)   # before anything is claimed: an error here leaves nothing queued
    with _LOCK:
        if key in _PENDING or key in _MEMORY or key in _FAILED:
            return
        _PENDING[key] = (problem, kernels)
        if not _WORKER or not _WORKER[0].is_alive():
            _WORKER[:] = [start_thread(_work, "epifuse-tuning")]


def _span(layout: _Layout) -> int:
    """The elements of storage a view of `layout` reaches from its first element."""
    if any(size == 0 for size in layout.shape):
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(layout.shape, layout.stride))


_NATIVE_RANDN = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fresh_tensor(layout: _Layout, generator=None) -> torch.Tensor:
    """A new tensor laid out as `layout` (broadcast and overlapping views included: the span of
    storage such a view reaches, viewed with its sizes and strides), of random values of its
    dtype: normal for floating point (drawn in float32 and converted for the 8-bit floats),
    small integers for integer dtypes, random for bool."""
    span, dtype, device = _span(layout), layout.dtype, layout.device
    draw = {"generator": generator, "device": device}
    if dtype == torch.bool:
        flat = torch.randint(0, 2, (span,), dtype=torch.uint8, **draw).bool()
    elif dtype.is_floating_point or dtype.is_complex:
        native = dtype in _NATIVE_RANDN or dtype.is_complex
        flat = torch.randn(span, dtype=dtype if native else torch.float32, **draw).to(dtype)
    else:
        low = 0 if torch.iinfo(dtype).min == 0 else -4
        flat = torch.randint(low, 5, (span,), dtype=dtype, **draw)
    return flat.as_strided(layout.shape, layout.stride)


def fresh_like(value, generator=None) -> torch.Tensor:
    """A new tensor with `value`'s shape, strides, dtype and device (a fake tensor's too),
    of random values as _fresh_tensor draws them."""
    return _fresh_tensor(_Layout(tuple(value.shape), tuple(value.stride()), value.dtype, value.device), generator)


def _generators(problem: _Problem) -> dict:
    """A random generator of its own for each device of `problem`'s tensors, so that the worker
    does not move the caller's random streams (meta tensors draw with none)."""
    layouts = [problem.A, problem.B, *problem.outputs.values(),
               *(v for v in problem.operands.values() if isinstance(v, _Layout))]
    generators = {}
    for device in {layout.device for layout in layouts}:
        if device.type != "meta":
            generators[device] = torch.Generator(device=device)
            generators[device].manual_seed(0)
    return generators


def _materialized(problem: _Problem) -> GemmArguments:
    """Arguments posing `problem` on fresh tensors (_fresh_tensor), writing into fresh outputs."""
    generators = _generators(problem)

    def fresh(layout):
        return _fresh_tensor(layout, generators.get(layout.device))
    operands = {n: fresh(v) if isinstance(v, _Layout) else v for n, v in problem.operands.items()}
    outputs = {n: fresh(layout) for n, layout in problem.outputs.items()}
    epilogue = EpilogueArguments(problem.program, accumulate=False, deterministic=problem.deterministic,
                                 compute_dtype=problem.compute_dtype, **{**operands, **outputs})
    return GemmArguments(fresh(problem.A), fresh(problem.B), epilogue=epilogue,
                         accumulator_type=problem.accumulator_type, precision=problem.precision)


@contextlib.contextmanager
def _on_own_stream(device: torch.device):
    """On a GPU: that device, and a stream of the worker's own (its work does not wait on the
    caller's stream, nor the caller's on it)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        yield


def _tune_problem(key: str, problem: _Problem, kernels) -> bool:
    """Time `kernels` on `problem` made of fresh tensors and remember the winner; whether that
    worked. The tensors live only while this runs."""
    try:
        with _on_own_stream(problem.A.device):
            _tune(_materialized(problem), kernels, key, "background")
    except Exception:  # noqa: BLE001 - the served choice stays; the next process tunes again
        return False
    return True


def _work() -> None:
    global _GENERATION
    while True:
        with _LOCK:
            if not _PENDING:
                _WORKER.clear()
                return
            key, (problem, kernels) = next(iter(_PENDING.items()))
        tuned = _tune_problem(key, problem, kernels)
        del problem, kernels
        with _LOCK:
            _PENDING.pop(key, None)
            if tuned:
                _GENERATION += 1
            else:
                _FAILED.add(key)
        if tuned:
            for listener in list(LISTENERS):
                listener()


def wait_for_background(timeout: float | None = None) -> bool:
    """Wait for background tuning to finish (for tests and scripts, and before capturing a CUDA
    graph); whether it has."""
    with _LOCK:
        worker = _WORKER[0] if _WORKER else None
    if worker is not None:
        worker.join(timeout)
        return not worker.is_alive()
    return True


CLOSE = 1.10  # candidates within 10 % of the fastest are timed a second time
# Tie-breaks (docs/design/tuning.md gives the measurements behind them): within 3 % of the
# fastest, about how much tuning's short timings of one kernel vary between runs, the kernel
# whose tiles read the fewest operand bytes per output wins, since lighter tiles hold up better
# in sustained timing than heavier ones that tie in short timings; among those as light, a
# Gluon kernel (Kernel.gluon) comes before a Triton one with the same tiles.
LIGHTER_WITHIN = 1.03
RANKING = (f"rule 2: time, then lighter tiles within {LIGHTER_WITHIN}, "
           "then Gluon")  # in the key: a new rule re-tunes
TUNE_WARMUP_MS, TUNE_REP_MS = 3, 15  # each timing (do_bench)


def _time_all(args, kernels, mode: str = "full"):
    scratch = _scratch_args(args)
    quiet = bool(os.environ.get("EPIFUSE_QUIET")) or mode == "background"   # no progress line over the caller's
    attempts = [0]
    calls: list = []  # (kernel, us) of every timing, in the order they ran
    _compile_before_timing(scratch, kernels)

    def time_ms(kernel) -> float:
        attempts[0] += 1
        if not quiet:
            step = f"{attempts[0]}/{len(kernels)}" if attempts[0] <= len(kernels) else "again"
            print(f"\repifuse: tuning {step} {kernel!r:60s}", end="", file=sys.stderr, flush=True)
        kernel.run(scratch)
        ms = do_bench(lambda: kernel.run(scratch), warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, return_mode="median")
        calls.append((repr(kernel), ms * 1e3))
        return ms

    timings = rank(kernels, time_ms)
    if not timings:
        return kernels[0]
    fastest = timings[0][2]
    sms = _sms(args)
    timings = lighter_first(timings, lambda kernel: operand_bytes_per_output(kernel, args, sms))
    ms, _, best = timings[0]
    HISTORY.append({"problem": f"{args.M}x{args.N}x{args.K}", "policy": mode, "choice": repr(best), "fastest": repr(fastest),
                    "timings_us": {repr(k): t * 1e3 for t, _, k in timings},
                    "calls_us": [[name, us] for name, us in calls]})
    if not quiet:
        print(f"\repifuse: chose {best!r} ({ms * 1e3:.1f} us) of {len(timings)} for "
              f"{args.M}x{args.N}x{args.K}", file=sys.stderr)
    return best


def _compile_before_timing(scratch, kernels) -> None:
    """On a GPU, compile every kernel before any is timed, all at once in runtime/ahead.py's
    pool (Triton spends most of a compile in ptxas and a launcher build, separate processes),
    waiting for all: each timing then finds its kernel compiled, and no compile competes with a
    timing for the host. Each kernel's plan is built here, on `scratch` (Kernel.compile_job:
    its buffers on this thread's stream, kept on scratch for the timing, and Triton's one-time
    set-up done here by the first, so the pool's threads start compiling together); the pool
    only compiles. A kernel that fails to plan or compile is left to its timing, which fails
    and drops it. Nothing here (each kernel compiles before its own timing) while the current
    stream captures a CUDA graph (no timing runs then either), under the interpreter, or with
    EPIFUSE_COMPILE_AHEAD=0."""
    device = scratch.A.device
    if len(kernels) < 2 or not ahead.compiles_on(device) or capturing(device):
        return
    jobs = []
    for kernel in dict.fromkeys(kernels):
        try:
            job = kernel.compile_job(scratch)
        except Exception:  # noqa: BLE001 - its timing raises it again and drops the kernel
            job = None
        if job is not None:
            jobs.append(job)
    for future in ahead.compile_all(jobs):
        future.exception()   # waits; a failed compile fails again in its timing


def _sms(args) -> int | None:
    """The SM count of args' GPU (None on a CPU or under the interpreter)."""
    return gpu_sms(args)


def operand_bytes_per_output(kernel, args, sms: int | None) -> float:
    """The A and B elements the tiles `kernel` runs for `args` read per output element,
    1/BLOCK_M + 1/BLOCK_N (its config after any fallback to smaller tiles). Infinite for a kernel
    without tiles, for a split-K one (its partial sums are bytes too), and for one whose tiles
    are fewer than `sms`, where fewer and larger tiles leave SMs idle."""
    config_of = getattr(kernel, "config_for", None)
    config = config_of(args) if config_of is not None else None
    if not hasattr(config, "block_m") or getattr(config, "split_k", 1) > 1:
        return float("inf")
    if sms is not None and output_tiles(args, config) < sms:
        return float("inf")
    return 1 / config.block_m + 1 / config.block_n


def lighter_first(timings: list, operand_bytes, within: float = LIGHTER_WITHIN) -> list:
    """`timings` (rank's, fastest first) with the kernel that reads the fewest `operand_bytes`
    per output among those within `within` of the fastest moved to the front; on a tie, a Gluon
    kernel, then the faster. A fastest kernel whose bytes are unknown (infinite) keeps its
    place."""
    if not timings or operand_bytes(timings[0][2]) == float("inf"):
        return timings
    near = [entry for entry in timings if entry[0] <= timings[0][0] * within]
    pick = min(near, key=lambda entry: (operand_bytes(entry[2]), not getattr(entry[2], "gluon", False), entry[0]))
    return [pick, *(entry for entry in timings if entry is not pick)]


def rank(kernels, time_ms, close: float = CLOSE) -> list[tuple[float, int, object]]:
    """(time, position, kernel) of every kernel `time_ms` can time (one that raises, say a
    config that fails to compile, is dropped), fastest first.

    The first kernel is timed again at the end of the first pass, and that time replaces its
    first: a GPU idle before tuning runs its first kernel faster (10-20 % at 8192^3 on an H100)
    than it runs the same kernel later, more than `close`, so that kernel alone would be
    chosen. A first kernel that cannot be timed again is dropped, not kept at that time.
    The GPU also heats up and slows down while tuning runs, so the kernels within `close` of
    the fastest are timed again, in the reverse of the order their kept times ran, and ranked
    by the mean of their two times: a drift that is linear in time then adds about the same to
    each."""
    timings = []
    for position, kernel in enumerate(kernels):
        try:
            timings.append([time_ms(kernel), position, kernel])
        except Exception:  # noqa: BLE001 - not chosen, whatever went wrong
            continue
    ran_at = {id(entry): order for order, entry in enumerate(timings)}
    if len(timings) > 1:  # the first timing ran before the GPU reached its working clock
        first = timings[0]
        try:
            first[0] = time_ms(first[2])
            ran_at[id(first)] = len(timings)
        except Exception:  # noqa: BLE001 - its one time is not comparable with the others
            timings.pop(0)
    if timings:
        fastest = min(t for t, _, _ in timings)
        contenders = [entry for entry in timings if entry[0] <= fastest * close]
        if len(contenders) > 1:
            for entry in sorted(contenders, key=lambda e: ran_at[id(e)], reverse=True):
                try:
                    entry[0] = (entry[0] + time_ms(entry[2])) / 2
                except Exception:  # noqa: BLE001 - keep its first time
                    pass
    return sorted((t, position, kernel) for t, position, kernel in timings)
