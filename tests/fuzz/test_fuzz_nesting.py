"""Fuzzing the nesting limit: random stacks of every construct that nests, parsed in threads
with small stacks, never crash the process.

Each source wraps `x` in layers drawn at random (brackets of every kind, calls, lambdas with and
without parameters, unary and binary operators on either side, attributes, subscripts,
conditional expressions, comprehensions, walrus, f-string fields), from a few layers to far
past the limit, in runs of one construct and mixed. Every source is parsed in a thread with a
128 KiB stack, in a subprocess so that a crash (SIGSEGV) fails the test: each one parses or
raises an EpilogueError, and sources past the limit are refused by it. The seed is the test's
(EPIFUSE_TEST_SEED replays it).
"""
from __future__ import annotations

import random

import pytest
import torch

from helpers import run_python

LAYERS = [
    "-{}", "+{}", "~{}", "not {}", "({})", "[{}]", "{{{}}}", "{{1: {}}}", "({},)", "f({})", "f(a={})",
    "relu({})", "lambda: {}", "lambda a, b=1: {}", "{}.a", "{}.relu()", "{}()", "{}[0]", "x[{}]",
    "x[::{}]", "{} + x", "x + {}", "{} * x", "x ** {}", "{} ** x", "{} if c else x", "x if c else {}",
    "x if {} else x", "x < {}", "{} and x", "x or {}", "[{} for y in x]", "(y for y in {})",
    "(y := {})", "await ({})", "*{}, x",
]
FSTRING = 'f"{{{}}}"'   # double quotes inside would end it: only ever the outermost layer


def _source(rng: random.Random) -> str:
    text = "x"
    runs = rng.randint(1, 4)
    for _ in range(runs):
        layer = rng.choice(LAYERS)
        count = rng.choice([rng.randint(1, 40), rng.randint(40, 600), rng.randint(600, 4000)])
        mixed = rng.random() < 0.5
        for _ in range(count):
            text = (rng.choice(LAYERS) if mixed else layer).format(text)
    if rng.random() < 0.2 and '"' not in text:
        text = FSTRING.format(text)
    return f"def epi(accum, x, c):\n    D = {text}\n    return D\n"


_SCRIPT = """
import sys, threading
from epifuse.errors import EpilogueError
from epifuse.frontend import parse
sources = {sources!r}
bad = []

def work():
    for i, source in enumerate(sources):
        try:
            parse(source)
        except EpilogueError:
            pass
        except BaseException as error:
            bad.append((i, repr(error)[:200]))

threading.stack_size(128 * 1024)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(bad)
sys.exit(1 if bad else 0)
"""


@pytest.mark.slow   # among the longest of the README's run (2-3 s or more each): CI runs it with -m slow
def test_random_nesting_never_crashes_a_small_stack():
    rng = random.Random(int(torch.randint(0, 2**31 - 1, ()).item()))
    sources = [_source(rng) for _ in range(300)]
    result = run_python(_SCRIPT.format(sources=sources), timeout=600)
    assert result.returncode == 0, (result.returncode, result.stdout[-3000:], result.stderr[-3000:])


def test_random_nesting_past_the_limit_is_refused_by_it():
    """Each construct alone, repeated past the limit (every layer counts at least 1 of its 512),
    within the source size limit: the error is the nesting limit's, not a RecursionError's nor
    a later stage's."""
    import pytest

    from epifuse.errors import EpilogueSyntaxError
    from epifuse.frontend import parse
    rng = random.Random(int(torch.randint(0, 2**31 - 1, ()).item()))
    for layer in LAYERS:
        if layer == "*{}, x":   # nested, its stars run together into '**', not valid Python
            continue
        text = "x"
        for _ in range(min(rng.randint(600, 3000), 95_000 // (len(layer) - 2))):
            text = layer.format(text)
        with pytest.raises(EpilogueSyntaxError, match="nesting limit"):
            parse(f"def epi(accum, x, c):\n    D = {text}\n    return D\n")
