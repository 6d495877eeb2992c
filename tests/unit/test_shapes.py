"""epifuse.shapes: operand roles, output strides, and which tensors share memory."""
import pytest
import torch

from epifuse import ops
from epifuse.errors import ShapeError
from epifuse.shapes import (accum_shape_of, check_tensor, classify_operand, is_stand_in, misalignment, output_strides,
                            overlaps, self_overlaps)

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


def test_reduction_outputs_take_keepdim_forms_less_leading_ones():
    """A (L, M, N) accum reduced over dims 0 and 2 gives (M,); (1, M, 1) keeps the dims and
    (M, 1) is that less its leading one, as torch broadcasting reads it: each names M's stride."""
    base = torch.empty(6, 3)
    for dest, stride in ((torch.empty(6), 1), (torch.empty(1, 6, 1), 1), (torch.empty(6, 1), 1), (base[:, 1:2], 3)):
        assert output_strides("r", dest, (4, 6, 8), CPU, ("L", "N"), ops.sum) == {"M": stride}, dest.shape
    assert output_strides("r", torch.empty(1, 8), (4, 6, 8), CPU, ("L", "M"), ops.sum) == {"N": 1}
    with pytest.raises(ShapeError, match=r"expected \(6,\), \(1, 6, 1\) or \(6, 1\)\."):
        output_strides("r", torch.empty(1, 6), (4, 6, 8), CPU, ("L", "N"), ops.sum)
    with pytest.raises(ShapeError, match=r"expected \(4, 6\) or \(4, 6, 1\)\."):
        output_strides("r", torch.empty(6, 1), (4, 6, 8), CPU, ("N",), ops.sum)


@pytest.mark.parametrize("make, phrase", [
    (lambda: torch._neg_view(torch.ones(6, 8)), "x has torch's negative bit set"),
    (lambda: torch.complex(torch.ones(6, 8), torch.ones(6, 8)).conj().imag, "x has torch's negative bit set"),
    (lambda: torch.ones(6, 8).to_sparse(), "x has layout torch.sparse_coo"),
    (lambda: torch.ones(6, 8).to_mkldnn(), "x has layout torch._mkldnn"),
    (lambda: torch.nested.nested_tensor([torch.ones(6, 8)]), "x is a nested tensor"),
    (lambda: torch.nested.nested_tensor([torch.ones(6, 8)], layout=torch.jagged), "x is a nested tensor"),
])
def test_tensors_kernels_cannot_read_as_they_are(make, phrase):
    with pytest.raises(ShapeError, match=phrase):
        check_tensor("x", make())


def test_a_storage_that_does_not_hold_the_view_is_refused():
    freed = torch.ones(6, 8)
    freed.untyped_storage().resize_(0)
    with pytest.raises(ShapeError, match="x's storage holds 0 bytes but the tensor reaches 192"):
        check_tensor("x", freed)
    view = torch.ones(4, 8)[2:]             # reaches the storage's end
    view.untyped_storage().resize_(96)      # three rows of four
    with pytest.raises(ShapeError, match="holds 96 bytes but the tensor reaches 128"):
        check_tensor("x", view)
    check_tensor("x", torch.ones(4, 8)[1:, ::2])
    empty = torch.ones(0, 8)
    empty.untyped_storage().resize_(0)
    check_tensor("x", empty)


def test_stand_ins_have_the_alignment_and_overlaps_of_their_metadata():
    """Meta and fake tensors have no addresses: they are aligned as a real tensor of their
    storage offset from an aligned allocation, and overlap only views of their own storage."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    fake = FakeTensorMode()
    for make in (lambda t: t.to("meta"), fake.from_tensor):
        base = make(torch.ones(10, 8))
        assert is_stand_in(base) and misalignment(base) == 0
        assert misalignment(base[0, 1:]) == 4 and misalignment(base[0, 4:]) == 0
        assert overlaps(base[:5], base[4:]) and not overlaps(base[:5], base[5:])
        assert not overlaps(base, make(torch.ones(10, 8)))
    assert not is_stand_in(torch.ones(2)) and misalignment(torch.ones(8)[1:]) == 4
