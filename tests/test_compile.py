"""torch.compile sees the scan as one custom op: full graphs, no graph break, same numbers."""

import torch

import fastrwa


def _loss(z, a, g):
    y, state = fastrwa.rda_scan(z, a, g, attention="sigmoid", output_final_state=True)
    return (y * y).mean() + state.average().mean()


def _grads(loss_fn, inputs):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    loss_fn(*leaves).backward()
    return [x.grad for x in leaves]


def test_op_compiles_fullgraph_forward_and_backward():
    torch.manual_seed(0)
    inputs = [torch.randn(2, 33, 8, requires_grad=True) for _ in range(3)]
    explained = torch._dynamo.explain(_loss)(*inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(_loss, fullgraph=True)
    for c, e in zip(_grads(compiled, inputs), _grads(_loss, inputs)):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


def test_step_compiles_fullgraph():
    torch.manual_seed(1)
    z, a = torch.randn(3, 6), torch.randn(3, 6)
    _, state = fastrwa.rwa_scan(torch.randn(3, 5, 6), torch.randn(3, 5, 6),
                                output_final_state=True)
    assert torch._dynamo.explain(fastrwa.rwa_step)(z, a, state).graph_break_count == 0
    y_c, st_c = torch.compile(fastrwa.rwa_step, fullgraph=True)(z, a, state)
    y_e, st_e = fastrwa.rwa_step(z, a, state)
    torch.testing.assert_close(y_c, y_e)
    torch.testing.assert_close(st_c.average(), st_e.average())
