"""The IR (epifuse.ir): interned nodes that hold their OpDef, leaves, Sym, graphs and verify."""
import pytest
import torch

from epifuse import ops
from epifuse.errors import InternalError
from epifuse.ir import (ACCUM, CONST, INPUT, Graph, Node, Operand, Output, Sym, accum, const, format_graph,
                        input_node, op, verify)

BIAS = Operand("bias", "tensor", ("N",))


def test_nodes_are_interned_by_op_sources_and_parameters():
    x = accum()
    assert accum() is x and x.op is ACCUM
    assert op(ops.mul, x, const(2.0)) is op("mul", x, const(2.0))
    assert op(ops.mul, x, const(2.0)) is not op(ops.mul, x, const(3.0))
    assert op(ops.leaky_relu, x, negative_slope=0.2) is op(ops.leaky_relu, x, negative_slope=0.2)
    assert op(ops.leaky_relu, x, negative_slope=0.2) is not op(ops.leaky_relu, x, negative_slope=0.1)


def test_literals_tell_signed_zeros_and_nans_apart():
    assert const(0.0) is not const(-0.0)
    assert const(float("nan")) is const(float("nan"))
    assert const(1.0) is const(1)


def test_a_node_holds_its_opdef_and_ops_compare_by_identity():
    node = op(ops.relu, accum())
    assert node.op is ops.relu and node.op.name == "relu"
    with pytest.raises(TypeError, match="compare ops by identity"):
        node.op == "relu"  # noqa: B015
    with pytest.raises(InternalError, match="a node's op is an OpDef"):
        Node("relu", (accum(),))


def test_nodes_are_immutable():
    node = op(ops.neg, accum())
    with pytest.raises(AttributeError, match="immutable"):
        node.op = ops.relu


def test_axes_and_dtypes_propagate():
    bias = input_node(BIAS)
    row = op(ops.add, const(1.0), bias)
    assert row.axes == frozenset({"N"}) and row.dtype == "float"
    tile = op(ops.gt, accum(), row)
    assert tile.axes == frozenset({"L", "M", "N"}) and tile.dtype == "bool"
    total = op(ops.sum, accum(), dim=("M", "N"))
    assert total.axes == frozenset({"L"}) and total.reduction is ops.sum.reduction
    assert total.dims == ("M", "N")


def test_arity_is_checked():
    with pytest.raises(InternalError, match="takes 2 inputs, got 1"):
        op(ops.add, accum())


def test_sym_builds_the_nodes_the_binder_would():
    x = Sym(accum())
    y = (x * 2.0 + 1.0).node
    assert y is op(ops.add, op(ops.mul, accum(), const(2.0)), const(1.0))
    assert ops.where(x > 0.0, x, 0.0).node is op(ops.where, op(ops.gt, accum(), const(0.0)), accum(), const(0.0))
    assert (-x).node is op(ops.neg, accum())
    with pytest.raises(TypeError, match="only Syms and numbers mix"):
        x + "1"


def test_ops_run_torch_on_tensors_and_build_ir_on_syms():
    assert torch.equal(ops.relu(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))
    assert ops.relu(Sym(accum())).node is op(ops.relu, accum())


def test_nodes_come_in_topological_order_each_once():
    x = accum()
    shared = op(ops.mul, x, x)
    graph = Graph((Output("D", op(ops.add, shared, shared)), Output("F", shared)), ())
    nodes = graph.nodes()
    assert nodes == [x, shared, op(ops.add, shared, shared)]
    assert graph.users()[id(shared)] == 3


def test_the_listing_names_what_the_user_named():
    x = accum()
    d = op(ops.relu, op(ops.add, x, input_node(BIAS)))
    graph = Graph((Output("D", d),), (BIAS,), names={d: "D"})
    assert format_graph(graph).splitlines() == [
        "%0 = accum()  : float[LMN]", "%1 = input(bias [tensor, axes=N])  : float[N]",
        "%2 = add(%0, %1)  : float[LMN]", "%3(D) = relu(%2)  : float[LMN]", "return D <- %3(D)"]


def test_verify_catches_malformed_graphs():
    x = accum()
    verify(Graph((Output("D", op(ops.relu, x)),), ()))
    with pytest.raises(InternalError, match="'bias' is not an operand"):
        verify(Graph((Output("D", op(ops.add, x, input_node(BIAS))),), ()))
    with pytest.raises(InternalError, match="a reduction other than one over N feeds another node"):
        verify(Graph((Output("D", op(ops.relu, op(ops.sum, x, dim=("M",)))),), ()))
    verify(Graph((Output("D", op(ops.relu, op(ops.sum, x, dim=("N",)))),), ()))   # one tile spans N
    with pytest.raises(InternalError, match="duplicate outputs"):
        verify(Graph((Output("D", x), Output("D", x)), ()))


def test_leaves_are_not_user_ops():
    assert ACCUM.is_leaf and CONST.is_leaf and INPUT.is_leaf
    assert "accum" not in ops.OPS and ops.lookup("const") is None
    with pytest.raises(ValueError, match="IR leaf"):
        ops.register(ACCUM)
