"""Glue rules (autograd ops between modules), one op at a time, against autograd double backward.

For ``y = f(a, b, ...)`` and a separable loss ``L = Σ (h/2) y² + c y`` (Hessian ``diag(h)`` in y, gradient
``g = h y + c``), the diagonal recursion through f is exact for each input: the rule's output for input
i must equal ``diag ∂²L/∂x_i²`` (float64). Dropout is checked on its own realized mask.
"""

import pytest
import torch
import torch.nn.functional as F

from nasdiag.hessian.glue import glue_rule_for

DT = torch.float64


def _diag_hessian(loss, x):
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    flat = g.reshape(-1)
    rows = [torch.autograd.grad(flat[i], x, retain_graph=True)[0].reshape(-1)[i] for i in range(flat.numel())]
    return torch.stack(rows).reshape(x.shape)


OPS = {
    "cat": (lambda a, b: torch.cat([a, b, a[:, :1]], 1), 2),
    "stack_sum": (lambda a, b: torch.stack([a, b]).sum(0), 2),
    "view_permute": (lambda a: a.view(3, 2, 2).permute(2, 0, 1), 1),
    "transpose_flip_roll": (lambda a: a.t().flip(0).roll(1, 1), 1),
    "slice_select_index": (lambda a: torch.cat([a[:, ::2].flatten(), a[1], a[[0, 2, 2]].flatten()]), 1),
    "expand_repeat": (lambda a: torch.cat([a[:, :1].expand(3, 3), a.repeat(1, 2)], 1), 1),
    "split_unbind": (lambda a: torch.cat([t.flatten() for t in (*a.split(1, 1), *a.unbind(0))]), 1),
    "pad": (lambda a: F.pad(a, (1, 2, 0, 1)), 1),
    "sum_dim": (lambda a: a.sum(1), 1),
    "mean_dim": (lambda a: a.mean(0), 1),
    "mean_all": (lambda a: a.mean().reshape(1), 1),
    "add_alpha": (lambda a, b: torch.add(a, b, alpha=-2.5), 2),
    "sub_alpha": (lambda a, b: torch.sub(a, b, alpha=1.5), 2),
    "rsub": (lambda a, b: torch.rsub(a, b, alpha=2.0), 2),
    "rsub_scalar": (lambda a: 1.0 - 3 * a, 1),
    "neg": (lambda a: -a, 1),
    "mul": (lambda a, b: a * b, 2),
    "mul_broadcast": (lambda a, b: a * b[:1], 2),
    "mul_scalar": (lambda a: a * 3.5, 1),
    "div_const": (lambda a: a / torch.linspace(1, 2, 4, dtype=DT), 1),
    "div_scalar": (lambda a: a / 4.0, 1),
    "softmax": (lambda a: torch.softmax(a, 1), 1),
    "softmax_dim0": (lambda a: torch.softmax(a, 0), 1),
    "log_softmax": (lambda a: torch.log_softmax(a, -1), 1),
    "sigmoid": (torch.sigmoid, 1),
    "tanh": (torch.tanh, 1),
    "relu": (torch.relu, 1),
    "where": (lambda a, b: torch.where(a > 0, a, b), 2),
    "max_pool": (lambda a: F.max_pool2d(a.view(1, 1, 3, 4), 2, 1), 1),
    "dropout": (lambda a: F.dropout(a, 0.4, training=True), 1),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_glue_rule_exact_for_separable_loss(op):
    torch.manual_seed(0)
    fn, n_in = OPS[op]
    inputs = [torch.randn(3, 4, dtype=DT, requires_grad=True) for _ in range(n_in)]
    y = fn(*inputs)
    h, c = torch.randn_like(y), torch.randn_like(y)
    loss = (0.5 * h * y.square() + c * y).sum()
    expected = [_diag_hessian(loss, x) for x in inputs]

    # walk from y down to the leaves through the glue nodes, as the engine does (one op may be several nodes)
    got = _walk(y, h, h * y.detach() + c, inputs)
    for x, e, gt in zip(inputs, expected, got):
        torch.testing.assert_close(gt, e, rtol=1e-10, atol=1e-12)


def _walk(y, h, g, leaves):
    """Minimal reverse-topological sweep over the glue nodes between y and the leaves."""
    order, seen = [], set()

    def visit(node):
        if node is None or node in seen:
            return
        seen.add(node)
        for n, _ in node.next_functions:
            visit(n)
        order.append(node)

    visit(y.grad_fn)
    leaf_nodes = {x.grad_fn if x.grad_fn is not None else _accumulator(x): i for i, x in enumerate(leaves)}
    buffers = {y.grad_fn: {y.output_nr: h}}
    grads = {y.grad_fn: g}  # only the ops with a residual read g, and they are the last op in OPS
    out = [torch.zeros_like(x) for x in leaves]
    with torch.no_grad():
        for node in reversed(order):
            slots = buffers.pop(node, None)
            if slots is None:
                continue
            if node in leaf_nodes:
                out[leaf_nodes[node]] += slots[0]
                continue
            rule = glue_rule_for(node)
            assert rule is not None, type(node).__name__
            n_out = max(len(node._input_metadata), max(slots) + 1)
            wanted = [n is not None for n, _ in node.next_functions]
            res = rule.apply(node, [slots.get(i) for i in range(n_out)], grads.get(node), wanted)
            for (child, nr), r in zip(node.next_functions, res):
                if child is None or r is None:
                    continue
                shape = tuple(child._input_metadata[nr].shape)
                r = r.sum_to_size(shape) if tuple(r.shape) != shape else r
                d = buffers.setdefault(child, {})
                d[nr] = r if nr not in d else d[nr] + r
    return out


def _accumulator(x):
    return torch.autograd.graph.get_gradient_edge(x).node
