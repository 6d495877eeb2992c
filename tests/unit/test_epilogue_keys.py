"""Epilogue keys, the custom ops' `epilogue` argument (epilogue_table.py): a key spells the whole
epilogue and reads back in any process; a forged or mutated key is refused as the parser
refuses its source, or means exactly what the parser reads, and is never run otherwise."""
import pytest
import torch

import epifuse
from epifuse import printing, torch_ops
from helpers import op_tensors as _tensors, relu_aux_loss

F64 = torch.float64


# ---- epilogue keys: the ops' `epilogue` argument spells the whole epilogue ------------------------

KEY_EPILOGUES = [
    relu_aux_loss,
    "def e(accum, b):\n    D = sigmoid(accum + b)\n    s = mean(D, dim=(0, 2))\n    return D, s\n",
    "def e(accum):\n    D = clamp(accum, -1e999, 0.5) * -0.0 + 1e-300\n    m = amax(D)\n    return D, m\n",
    "def e(accum, C):\n    D = where(accum > C, accum.half().float(), C ** 2)\n    return D\n",
]


@pytest.mark.parametrize("epilogue", KEY_EPILOGUES)
def test_program_dump_round_trips(epilogue):
    program = epifuse.frontend.parse(epilogue)
    text = printing.dump_program(program)
    assert printing.load_program(text) == program


@pytest.mark.parametrize("epilogue", KEY_EPILOGUES)
def test_keys_survive_generated_source_unescaped(epilogue):
    """Inductor writes the ops' string arguments into the Python it generates without escaping
    them (a newline or a quote in the key was a SyntaxError in the compiled backward on CUDA)."""
    import re
    for save_accum in (False, True):
        key = torch_ops.entry(torch_ops.register_epilogue(epilogue, save_accum=save_accum)).key
        assert re.fullmatch(r"[A-Za-z0-9_=:-]+", key), key[:80]
        assert eval(f"'{key}'") == key  # noqa: S307 - the test is that this literal reads back


def test_unreadable_keys_are_clear_errors():
    import base64
    import hashlib
    import json
    import zlib
    key = torch_ops.entry(torch_ops.register_epilogue(relu_aux_loss)).key
    tag, save, digest, body = key.split(":")
    text = zlib.decompress(base64.urlsafe_b64decode(body)).decode()

    def signed(text):
        body = base64.urlsafe_b64encode(zlib.compress(text.encode(), 9)).decode()
        return f"{tag}:{save}:{hashlib.sha256(text.encode()).hexdigest()[:32]}:{body}"

    assert signed(text) == key  # the format the broken keys below are forged in
    program = json.loads(text)
    bad_name = json.loads(text)
    bad_name[3][0][0] = "D; import os"
    bad_op = json.loads(text)
    bad_op[3][0][1][0] = "call"
    bad_op[3][0][1][1] = "system"
    assert program[3][0][0] == "F"
    # control: re-dumped but unchanged, a forged key reads back, so each rejection below is its edit's
    assert torch_ops.resolve(signed(json.dumps(program))).program == torch_ops.resolve(key).program
    broken = [key.replace(digest, "0" * 32), "not a key", f"{tag}:0:{'1' * 32}:!!!", signed("[1, 2]"),
              signed("[" * 100000 + "]" * 100000),
              signed(json.dumps(bad_name)), signed(json.dumps(bad_op))]
    gelu_key = torch_ops.entry(torch_ops.register_epilogue(
        "def e(accum):\n    D = gelu(accum, approximate='tanh')\n    return D\n")).key
    gelu_text = zlib.decompress(base64.urlsafe_b64decode(gelu_key.split(":")[3])).decode()
    assert "tanh" in gelu_text
    broken += [signed(gelu_text.replace('"tanh"', '"tanh\')); import os #"')),
               signed(gelu_text.replace('"approximate"', '"alpha"')),
               signed(gelu_text.replace('[["name","accum",[],[],', '[["name","accum",[["const",1,[],[],null]],[],'))]
    t = _tensors(grad=False)
    for bad in broken:
        with pytest.raises(epifuse.EpilogueError, match="cannot read"):
            torch.ops.epifuse.gemm(bad, t["A"], t["B"], [t["C"], t["bias"]], [3.0], "ntt", "", F64,
                                   False, "default")


# ---- a key passes the parser's checks: a forged one is refused, never run ----------------------

_FORGED_SOURCE = ("def e(accum, alpha, C, bias):\n    F = accum * alpha + C * 2.0 + bias\n"
                  "    D = leaky_relu(F, 0.2)\n    r = sum(D, dim=1)\n    return D, F, r\n")


def _key_parts(epilogue):
    """(tag, save flag, the program as JSON) of `epilogue`'s key."""
    import base64
    import json
    import zlib
    tag, save, _, body = torch_ops.entry(torch_ops.register_epilogue(epilogue)).key.split(":")
    return tag, save, json.loads(zlib.decompress(base64.urlsafe_b64decode(body)).decode())


def _signed(tag, save, text):
    """A key for the JSON `text` with a valid digest: what a forger can always make."""
    import base64
    import hashlib
    import zlib
    body = base64.urlsafe_b64encode(zlib.compress(text.encode(), 9)).decode()
    return f"{tag}:{save}:{hashlib.sha256(text.encode()).hexdigest()[:32]}:{body}"


def _name(value):
    return ["name", value, [], [], None]


def _const(value):
    return ["const", value, [], [], None]


def _nested(depth):
    """JSON text of `depth` nested neg() calls around accum (built as text: json.dumps recurses)."""
    return '["call","neg",[' * depth + '["name","accum",[],[],null]' + '],[],null]' * depth


# Each edit makes the program something the parser never returns (statements: F, D, r).
FORGERIES = {
    "an output returned twice": lambda p: p[4].append(p[4][0]),
    "no output": lambda p: p.__setitem__(4, []),
    "an output never assigned": lambda p: p[4][0].__setitem__(0, "zz"),
    "a name never assigned": lambda p: p[3][0].__setitem__(1, _name("zz")),
    "a name read before it is assigned": lambda p: p[3][0].__setitem__(1, _name("D")),
    "a variable assigned twice": lambda p: p[3][2].__setitem__(0, "F"),
    "a parameter assigned": lambda p: p[3][2].__setitem__(0, "C"),
    "no accum parameter": lambda p: p[1].__setitem__(0, "acc"),
    "a parameter listed twice": lambda p: p[1].__setitem__(2, "alpha"),
    "a parameter named as an option": lambda p: p[1].__setitem__(1, "accumulate"),
    "an output named as an option": lambda p: (p[3].append(["deterministic", _name("F"), None]),
                                               p[4].append(["deterministic", None])),
    "a dunder parameter": lambda p: p[1].__setitem__(1, "__alpha"),
    "a non-ASCII variable": lambda p: p[3][2].__setitem__(0, "\u0435"),
    "a function name Python refuses": lambda p: p.__setitem__(0, "class"),
    "parameters without their places": lambda p: p[2].pop(),
    "an int literal": lambda p: p[3][0].__setitem__(1, _const(2)),
    "an int literal too large for a float": lambda p: p[3][0].__setitem__(1, _const(10 ** 400)),
    "a bool literal": lambda p: p[3][0].__setitem__(1, _const(True)),
    "an int parameter": lambda p: p[3][1][1][3].__setitem__(0, ["negative_slope", 1]),
    "an int parameter too large for a float": lambda p: p[3][1][1][3].__setitem__(0, ["negative_slope", 10 ** 400]),
    "a parameter given twice": lambda p: p[3][1][1][3].append(["negative_slope", {"f": (0.5).hex()}]),
    "clamp without a bound": lambda p: p[3][1].__setitem__(1, ["call", "clamp", [_name("F")], [], None]),
    "a dim that is not a tuple": lambda p: p[3][2][1][3].__setitem__(0, ["dim", 1]),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forged_keys_are_refused_as_the_parser_refuses(forgery):
    """A key is read in another process, maybe from disk: its program passes the parser's
    checks or the op refuses it with an EpilogueError (an output returned twice came back as a
    tensor nothing wrote; other forgeries raised KeyError, TypeError or OverflowError)."""
    import json
    tag, save, program = _key_parts(_FORGED_SOURCE)
    t = _tensors(grad=False)
    def call(key):
        return torch.ops.epifuse.gemm(key, t["A"], t["B"], [t["C"], t["bias"]], [3.0], "ntt", "", F64,
                                      False, "default")

    # control: the same program re-dumped (another spacing) is read and runs
    expected = epifuse.gemm(t["A"], t["B"], _FORGED_SOURCE, alpha=3.0, C=t["C"], bias=t["bias"])
    for got, want in zip(call(_signed(tag, save, json.dumps(program))), expected, strict=True):
        assert torch.equal(got, want)
    FORGERIES[forgery](program)
    with pytest.raises(epifuse.EpilogueError, match="cannot read"):
        call(_signed(tag, save, json.dumps(program)))


def test_forged_keys_nested_too_deep_or_too_long_are_refused():
    import json
    tag, save, program = _key_parts(_FORGED_SOURCE)
    program[3][0][1] = "NESTED"
    text = json.dumps(program)
    t = _tensors(grad=False)
    for key in (_signed(tag, save, text.replace('"NESTED"', _nested(1200))),
                _signed(tag, save, json.dumps(_key_parts(_FORGED_SOURCE)[2]) + " " * (1 << 26))):
        with pytest.raises(epifuse.EpilogueError, match="cannot read"):
            torch.ops.epifuse.gemm(key, t["A"], t["B"], [t["C"], t["bias"]], [3.0], "ntt", "", F64,
                                   False, "default")
    shallow = _signed(tag, save, text.replace('"NESTED"', _nested(50)))
    assert torch_ops.read_key(shallow)[0].statements[0].expr.value == "neg"


_POOL = [0, 1, -1, 2, 10 ** 30, 10 ** 400, True, False, None, "", "accum", "alpha", "C", "bias", "F",
         "D", "r", "zz", "__x", "accumulate", "sum", "clamp", "neg", "add", "where", "name", "const",
         "call", [], [1], {"f": "0x1p0"}, {"f": "inf"}, {"t": [1]}, {"t": []}, {"t": [5]}, {"t": [0, 0]},
         _name("accum"), _name("F"), _const({"f": "0x1p-1"}), ["dim", {"t": [0]}], ["approximate", "tanh"]]


def _positions(x, path=()):
    yield path
    if isinstance(x, list):
        for i, v in enumerate(x):
            yield from _positions(v, path + (i,))


def test_mutated_keys_are_refused_or_mean_what_the_parser_reads():
    """Random edits of a key's program: each is refused with an EpilogueError, or the program
    is one the parser accepts (printed back to source) and the op computes what that source
    computes, or fails as it fails."""
    import copy
    import json
    import random
    rng = random.Random(int(torch.randint(0, 2 ** 31, ())))
    t = _tensors(grad=False)
    epilogues = [_FORGED_SOURCE,
                 ("def e(accum, alpha, C, bias):\n    F = clamp(accum, min=-1.0) + gelu(C, approximate='tanh')\n"
                  "    D = where(F > bias, F.half(), alpha)\n    r = amax(D, dim=(0, 1))\n    return D, r\n")]
    ran = 0
    for epilogue in epilogues:
        tag, _, original = _key_parts(epilogue)
        for _ in range(400):
            program = copy.deepcopy(original)
            for _ in range(rng.choice((1, 1, 2))):
                path = rng.choice([q for q in _positions(program) if q])
                parent = program
                for i in path[:-1]:
                    parent = parent[i]
                value = copy.deepcopy(rng.choice(_POOL))
                action = rng.random()
                if action < 0.1:
                    del parent[path[-1]]
                elif action < 0.2:
                    parent.insert(path[-1], value)
                else:
                    parent[path[-1]] = value
            saves = rng.choice("01")
            key = _signed(tag, saves, json.dumps(program))
            try:
                read, _ = torch_ops.read_key(key)
            except epifuse.EpilogueError:
                continue
            source = printing.program_source(read)
            try:
                want = epifuse.gemm(t["A"], t["B"], source, alpha=3.0, C=t["C"], bias=t["bias"])
            except Exception as exc:   # noqa: BLE001 - the key must fail as its source does
                with pytest.raises(type(exc)):
                    torch.ops.epifuse.gemm(key, t["A"], t["B"], [t["C"], t["bias"]], [3.0], "ntt", "",
                                           F64, False, "default")
                continue
            got = torch.ops.epifuse.gemm(key, t["A"], t["B"], [t["C"], t["bias"]], [3.0], "ntt", "", F64,
                                         False, "default")
            want = (want if isinstance(want, tuple) else (want,)) + (
                (t["A"] @ t["B"],) if saves == "1" else ())   # the saved accum, an extra output
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a.nan_to_num(), b.nan_to_num()), source
            ran += 1
    assert ran  # some edits keep a program (a literal changed, an op swapped)
