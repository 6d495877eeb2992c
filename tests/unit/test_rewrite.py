"""epifuse.rewrite: rules applied bottom-up to a fixed point, never mutating a node."""
from epifuse import ops
from epifuse.ir import CONST, Graph, Output, accum, const, op
from epifuse.rewrite import rewrite


def times_one(node):
    """x * 1 -> x"""
    if node.op is ops.mul and node.src[1].op is CONST and node.src[1].arg == 1.0:
        return node.src[0]
    return None


def neg_to_mul(node):
    """-x -> x * -1 (a rule that builds a node other rules then see)"""
    if node.op is ops.neg:
        return op(ops.mul, node.src[0], const(-1.0))
    return None


def test_nothing_to_do_returns_the_same_nodes():
    x = op(ops.relu, accum())
    graph = Graph((Output("D", x),), ())
    assert rewrite(graph, [times_one]).outputs[0].node is x


def test_rules_apply_sources_first_to_a_fixed_point():
    x = accum()
    deep = op(ops.relu, op(ops.mul, op(ops.mul, x, const(1.0)), const(1.0)))
    assert rewrite(Graph((Output("D", deep),), ()), [times_one]).outputs[0].node is op(ops.relu, x)


def test_nodes_a_rule_builds_are_rewritten_too():
    x = accum()
    graph = Graph((Output("D", op(ops.neg, op(ops.neg, x))),), ())
    out = rewrite(graph, [neg_to_mul]).outputs[0].node
    assert out is op(ops.mul, op(ops.mul, x, const(-1.0)), const(-1.0))


def test_names_and_places_follow_the_rewritten_node():
    x = accum()
    d = op(ops.mul, op(ops.relu, x), const(1.0))
    graph = Graph((Output("D", d),), (), names={d: "D"}, locs={d: "here"})
    out = rewrite(graph, [times_one])
    new = out.outputs[0].node
    assert new is op(ops.relu, x) and out.name_of(new) == "D" and out.loc_of(new) == "here"
    assert graph.name_of(new) is None  # the input graph is untouched
