"""epifuse.shapes: operand roles, output strides, and which tensors share memory."""
import pytest
import torch

from epifuse import ops
from epifuse.errors import ShapeError
from epifuse.shapes import accum_shape_of, classify_operand, output_strides, overlaps, self_overlaps

CPU = torch.device("cpu")


@pytest.mark.parametrize("value,kind,axes", [
    (2.0, "number", ()), (torch.ones(1), "tensor", ()), (torch.ones(1, 1), "tensor", ()),
    (torch.ones(8), "tensor", ("N",)), (torch.ones(1, 8), "tensor", ("N",)),
    (torch.ones(6, 1), "tensor", ("M",)), (torch.ones(6, 8), "tensor", ("M", "N")),
])
def test_roles_follow_torch_broadcasting(value, kind, axes):
    role, strides = classify_operand("x", value, (6, 8), CPU)
    assert (role.kind, role.axes) == (kind, axes)
    assert set(strides) == set(axes)


def test_batched_roles():
    assert classify_operand("s", torch.ones(3, 1, 1), (3, 6, 8), CPU)[0].axes == ("L",)
    role, strides = classify_operand("c", torch.ones(3, 6, 1), (3, 6, 8), CPU)
    assert role.axes == ("L", "M") and strides == {"L": 6, "M": 1}


def test_a_shape_that_does_not_broadcast_is_named():
    with pytest.raises(ShapeError, match=r"Operand bias with shape \(7,\) does not broadcast against accum \(6, 8\)"):
        classify_operand("bias", torch.ones(7), (6, 8), CPU)


def test_accum_shapes_and_their_errors():
    assert accum_shape_of(torch.ones(6, 4), torch.ones(4, 8)) == ((6, 8), (1, 6, 8, 4))
    assert accum_shape_of(torch.ones(3, 6, 4), torch.ones(4, 8)) == ((3, 6, 8), (3, 6, 8, 4))
    with pytest.raises(ShapeError, match="A has K=4 columns but B has 5 rows"):
        accum_shape_of(torch.ones(6, 4), torch.ones(5, 8))
    with pytest.raises(ShapeError, match="batch sizes must match"):
        accum_shape_of(torch.ones(2, 6, 4), torch.ones(3, 4, 8))


def test_reduction_outputs_keep_or_drop_their_dims():
    rows = output_strides("r", torch.empty(6), (6, 8), CPU, ("N",), ops.sum)
    kept = output_strides("r", torch.empty(6, 1), (6, 8), CPU, ("N",), ops.sum)
    assert rows == kept == {"L": 0, "M": 1}
    with pytest.raises(ShapeError, match=r"expected \(6,\) or \(6, 1\)"):
        output_strides("r", torch.empty(8), (6, 8), CPU, ("N",), ops.sum)
    with pytest.raises(ShapeError, match="reduces an empty dimension, which has no maximum"):
        output_strides("m", torch.empty(8), (0, 8), CPU, ("M",), ops.max)
    with pytest.raises(ShapeError, match="which has no minimum"):
        output_strides("m", torch.empty(8), (0, 8), CPU, ("M",), ops.min)
    assert output_strides("s", torch.empty(8), (0, 8), CPU, ("M",), ops.sum) == {"L": 0, "N": 1}


def test_outputs_that_write_one_element_twice_are_refused():
    assert self_overlaps(torch.ones(1, 8).expand(6, 8))
    assert self_overlaps(torch.ones(20).as_strided((4, 4), (3, 2)))     # interleaved rows
    assert not self_overlaps(torch.ones(6, 8)) and not self_overlaps(torch.ones(8, 6).t())
    with pytest.raises(ShapeError, match="share memory"):
        output_strides("D", torch.ones(1, 8).expand(6, 8), (6, 8), CPU, None, None)


def test_overlap_between_tensors():
    base = torch.ones(10, 8)
    assert overlaps(base[:5], base[4:]) and not overlaps(base[:5], base[5:])
    assert not overlaps(base, torch.ones(10, 8))
