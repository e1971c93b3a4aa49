"""One rank of tests/context_parallel/test_scan_and_layers.py's layer and model cases:
``python layers_worker.py RANK WORLD STORE LENGTHS``.

Every rank builds the same modules and inputs, runs the whole sequence in one process (the
reference), then its own slice with ``context_group`` over gloo, and checks its outputs, the
gradient of its input slice, the final state (last rank) and the parameters' gradients
(summed over the ranks, as data parallelism sums them) against the reference: float64 within
1e-12, float32 within 1e-5. Cases: RWA and RDA layers with and without token shift,
bidirectional, time-first; a ByteLM with a state passed on rank 0; float32; and refusals
(every rank raises, none waits). Prints ``OK`` and exits 0, or raises (exit 1).
"""

import gc
import os
import sys

import torch
import torch.distributed as dist

import fastrwa
from fastrwa.models import ByteLM, LMConfig

rank, world, store, lengths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
lengths = [int(n) for n in lengths.split(",")]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
group = dist.group.WORLD
lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
T, B = sum(lengths), 2
LAST = world - 1


def check(name, got, want, tol):
    if got is None or got.shape != want.shape:
        raise AssertionError(f"rank {rank}: {name}: got {None if got is None else got.shape}, "
                             f"want {tuple(want.shape)}")
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    if not err <= tol * scale:
        raise AssertionError(f"rank {rank}: {name}: max error {err:.3g} (scale {scale:.3g})")


def summed_grads(module):
    """Every parameter's gradient summed over the ranks (zeros where a rank had none)."""
    grads = []
    for p in module.parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)
        grads.append(g)
    return grads


def final_terms(layer, state, wf, wl, where):
    """The loss's terms of a layer's final state that ``where`` holds for the whole sequence
    ("all": one process; "mine": this rank's share): the average ``n / d`` of the forward
    channels (the last rank) and of the reverse ones (rank 0), and the last input (the last
    rank)."""
    H = layer.hidden_size
    average = state.scan.n / state.scan.d
    total = average.new_zeros(())
    if where == "all" or rank == LAST:
        total = total + (average[:, :H] * wf[:, :H]).sum()
        if state.last_input is not None:
            total = total + (state.last_input * wl).sum()
    if layer.bidirectional and (where == "all" or rank == 0):
        total = total + (average[:, H:] * wf[:, H:]).sum()
    return total


def layer_case(label, make, dtype, tol, time_first=False):
    torch.manual_seed(3)
    layer = make().to(dtype)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(B, T, layer.input_size, generator=gen, dtype=dtype)
    out, _ = layer(x[:, :1])                              # (the output width)
    w = torch.randn(B, T, out.shape[-1], generator=gen, dtype=dtype)
    wf = torch.randn(B, out.shape[-1], generator=gen, dtype=dtype)
    wl = torch.randn(B, layer.input_size, generator=gen, dtype=dtype)
    full_x = x.clone().requires_grad_()
    y, final = layer(full_x.transpose(0, 1) if time_first else full_x)
    y = y.transpose(0, 1) if time_first else y
    ((y * w).sum() + final_terms(layer, final, wf, wl, "all")).backward()
    want_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    mine = x[:, lo:hi].clone().requires_grad_()
    ys, fs = layer(mine.transpose(0, 1) if time_first else mine, context_group=group)
    ys = ys.transpose(0, 1) if time_first else ys
    check(f"{label}: y", ys.detach(), y.detach()[:, lo:hi], tol)
    ((ys * w[:, lo:hi]).sum() + final_terms(layer, fs, wf, wl, "mine")).backward()
    check(f"{label}: grad x", mine.grad, full_x.grad[:, lo:hi], tol)
    for (name, _), got, want in zip(layer.named_parameters(), summed_grads(layer), want_grads):
        check(f"{label}: grad {name}", got, want, tol)
    H = layer.hidden_size
    for holder, channels in ((LAST, slice(0, H)), (0, slice(H, 2 * H))):
        if rank == holder and (channels.start == 0 or layer.bidirectional):
            check(f"{label}: final n/d {channels}", (fs.scan.n / fs.scan.d)[:, channels].detach(),
                  (final.scan.n / final.scan.d)[:, channels].detach(), tol)
    if rank == LAST and final.last_input is not None:
        check(f"{label}: final last_input", fs.last_input.detach(), final.last_input.detach(),
              tol)
    # the other route: torch.autograd.grad from the output alone, for the input and the
    # parameters (an empty slice's rank skipped the token shift's all-reduce there)
    params = list(layer.parameters())
    full_x = x.clone().requires_grad_()
    y, _ = layer(full_x.transpose(0, 1) if time_first else full_x)
    y = y.transpose(0, 1) if time_first else y
    want = torch.autograd.grad(y, [full_x, *params], w, allow_unused=True)
    mine = x[:, lo:hi].clone().requires_grad_()
    ys, _ = layer(mine.transpose(0, 1) if time_first else mine, context_group=group)
    ys = ys.transpose(0, 1) if time_first else ys
    got = torch.autograd.grad(ys, [mine, *params], w[:, lo:hi], allow_unused=True)
    check(f"{label}: autograd.grad x", got[0], want[0][:, lo:hi], tol)
    for (name, p), g, wg in zip(layer.named_parameters(), got[1:], want[1:]):
        g = torch.zeros_like(p) if g is None else g.clone()
        dist.all_reduce(g)
        check(f"{label}: autograd.grad {name}", g, torch.zeros_like(p) if wg is None else wg,
              tol)


def model_case(label, dtype, tol, with_state):
    torch.manual_seed(5)
    model = ByteLM(LMConfig(d_model=8, n_layers=2, mlp_ratio=2)).to(dtype)
    gen = torch.Generator().manual_seed(13)
    tokens = torch.randint(0, 256, (B, T), generator=gen)
    target = torch.randint(0, 256, (B, T), generator=gen)
    state = None
    if with_state:
        with torch.no_grad():
            _, state = model(torch.randint(0, 256, (B, 5), generator=gen))

    def loss_of(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 target.reshape(-1), reduction="sum")

    logits, final = model(tokens, state)
    loss_of(logits, target).backward()
    want_grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                  for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    mine, mine_final = model(tokens[:, lo:hi], state if rank == 0 else None,
                             context_group=group)
    check(f"{label}: logits", mine.detach(), logits.detach()[:, lo:hi], tol)
    if rank == LAST:                        # (the state a next segment starts from)
        for k, (got, want) in enumerate(zip(mine_final.layers, final.layers)):
            check(f"{label}: final state {k} n/d", (got.scan.n / got.scan.d).detach(),
                  (want.scan.n / want.scan.d).detach(), tol)
            check(f"{label}: final state {k} last input", got.last_input.detach(),
                  want.last_input.detach(), tol)
    loss_of(mine, target[:, lo:hi]).backward()
    for (name, _), got, want in zip(model.named_parameters(), summed_grads(model), want_grads):
        check(f"{label}: grad {name}", got, want, tol)


def refused(label, call, words):
    """``call`` raises ValueError on every rank (the refusing rank's own error, or the
    others' 'refused' naming it)."""
    try:
        call()
    except ValueError as exc:
        if not any(w in str(exc) for w in words):
            raise AssertionError(f"rank {rank}: {label}: unexpected error {exc}") from exc
        return
    raise AssertionError(f"rank {rank}: {label}: no error")


# packed sequences over the ranks: a sequence ends one past every rank boundary, so one runs
# across each (and across an empty slice), and an empty one after the first
# (lengths 1, 6: 0, 2, 2, 7; 2, 0, 3: 0, 3, 3, 5; 2, 3, 1, 2: 0, 3, 3, 6, 7, 8)
EDGES = [sum(lengths[:j]) for j in range(1, world)]
CROSS = sorted({e + 1 for e in EDGES if e + 1 < T})
CU = torch.tensor(sorted([0, T, *CROSS, *CROSS[:1]]))


def packed_case(label, make, dtype, tol, model=False):
    """A layer (or a ByteLM, ``model``) over packed sequences that span the ranks (global
    ``CU``): this slice's outputs, its inputs' gradient and the parameters' gradients
    summed over the ranks equal one process's on the whole packed sequence."""
    torch.manual_seed(0)
    module = make().to(dtype)
    gen = torch.Generator().manual_seed(5)
    if model:
        inputs = torch.randint(0, 256, (1, T), generator=gen)
        width = module.config.vocab_size
    else:
        inputs = torch.randn(1, T, 3, generator=gen, dtype=torch.float64).to(dtype)
        width = module.hidden_size * module.num_directions
    w = torch.randn(1, T, width, generator=gen, dtype=torch.float64).to(dtype)
    whole = inputs if model else inputs.clone().requires_grad_()
    out, _ = module(whole, cu_seqlens=CU)
    (out * w).sum().backward()
    want_grads = [p.grad.clone() for p in module.parameters()]
    want_x = None if model else whole.grad[:, lo:hi]
    module.zero_grad()
    mine = inputs[:, lo:hi] if model else inputs[:, lo:hi].clone().requires_grad_()
    got, _ = module(mine, cu_seqlens=CU, context_group=group)
    check(f"{label}: y", got.detach(), out.detach()[:, lo:hi], tol)
    (got * w[:, lo:hi]).sum().backward()
    if not model:
        check(f"{label}: grad x", mine.grad, want_x, tol)
    for (name, _), g, want in zip(module.named_parameters(), summed_grads(module), want_grads):
        check(f"{label}: grad {name}", g, want, tol)


F64, F32 = torch.float64, torch.float32
for shift in (False, True):
    packed_case(f"packed rwa shift={shift}", lambda: fastrwa.nn.RWA(3, 4, token_shift=shift),
                F64, 1e-12)
    packed_case(f"packed rda shift={shift}",
                lambda: fastrwa.nn.RDA(3, 4, attention="sigmoid", token_shift=shift),
                F64, 1e-12)
packed_case("packed bidirectional rda",
            lambda: fastrwa.nn.RDA(3, 4, bidirectional=True, token_shift=True), F64, 1e-12)
packed_case("packed bytelm", lambda: ByteLM(LMConfig(d_model=8, n_layers=2, mlp_ratio=2)),
            F64, 1e-12, model=True)
packed_case("packed bytelm rwa float32",
            lambda: ByteLM(LMConfig(d_model=8, n_layers=1, layer="rwa", mlp_ratio=2)),
            F32, 1e-5, model=True)
for shift in (False, True):
    layer_case(f"rwa shift={shift}", lambda: fastrwa.nn.RWA(3, 4, token_shift=shift), F64, 1e-12)
    for attention in ("exp", "sigmoid"):
        layer_case(f"rda {attention} shift={shift}",
                   lambda: fastrwa.nn.RDA(3, 4, attention=attention, token_shift=shift),
                   F64, 1e-12)
    layer_case(f"bidirectional rda shift={shift}",
               lambda: fastrwa.nn.RDA(3, 4, bidirectional=True, token_shift=shift), F64, 1e-12)
layer_case("time-first rwa", lambda: fastrwa.nn.RWA(3, 4, batch_first=False, token_shift=True),
           F64, 1e-12, time_first=True)
layer_case("float32 rda", lambda: fastrwa.nn.RDA(3, 4, token_shift=True), F32, 1e-5)
model_case("bytelm", F64, 1e-12, with_state=False)
model_case("bytelm with state", F64, 1e-12, with_state=True)
model_case("bytelm float32", F32, 1e-5, with_state=False)

layer = fastrwa.nn.RDA(3, 4, token_shift=True).double()
x = torch.randn(B, hi - lo, 3 if rank != LAST else 5, dtype=F64)
refused("a wrong width on the last rank", lambda: layer(x, context_group=group),
        ["input_size", "refused"])
x = torch.randn(B, hi - lo, 3, dtype=F64)
_, state = layer(torch.randn(B, 2, 3, dtype=F64))
refused("a state on every rank", lambda: layer(x, state, context_group=group),
        ["rank 0 only", "refused"])
refused("a batch that differs", lambda: layer(x[:1] if rank == 0 else x, context_group=group),
        ["batch B"])
model = ByteLM(LMConfig(d_model=8, n_layers=1, mlp_ratio=2))
tokens = torch.randint(0, 256, (B, hi - lo))
if rank == LAST:
    tokens[0, -1:] = 300                    # (out of the vocabulary, on one rank)
refused("a token id out of range on the last rank",
        lambda: model(tokens, context_group=group), ["ids in [0, 257)", "refused"])
tokens = torch.randint(0, 256, (B, hi - lo))
mask = torch.ones(B, hi - lo, dtype=torch.bool) if rank == 0 else None
refused("a mask on rank 0 only (a layer)",
        lambda: layer(x, mask=mask, context_group=group), ["cannot be combined", "refused"])
refused("a mask on rank 0 only (ByteLM)",
        lambda: model(tokens, mask=mask, context_group=group),
        ["cannot be combined", "refused"])
cu = torch.tensor([0, hi - lo]) if rank == 0 else None
refused("cu_seqlens on rank 0 only",
        lambda: layer(x[:1] if rank == 0 else x, cu_seqlens=cu, context_group=group),
        ["cu_seqlens", "batch B", "refused"])
packed_x = torch.randn(1, hi - lo, 3, dtype=F64)
refused("other cu_seqlens on the last rank",
        lambda: layer(packed_x, cu_seqlens=torch.tensor([0, 1 if rank == LAST else 0, T]),
                      context_group=group), ["cu_seqlens", "refused"])
refused("cu_seqlens that end before the whole sequence",
        lambda: layer(packed_x, cu_seqlens=torch.tensor([0, T - 1]), context_group=group),
        ["must end at its length", "refused"])
other = ByteLM(LMConfig(d_model=8, n_layers=1 if rank == 0 else 2, mlp_ratio=2))
refused("ByteLM with another layer count on rank 0", lambda: other(tokens, context_group=group),
        ["model configuration"])
other = fastrwa.nn.RDA(3, 4, token_shift=True, attention="exp" if rank else "sigmoid").double()
refused("a layer with another option on rank 0", lambda: other(x, context_group=group),
        ["layer (class, sizes and options)"])
dist.barrier()
del group
gc.collect()
dist.destroy_process_group()
print("OK", flush=True)
# (gloo's threads can abort a process in the interpreter's teardown, "terminate called
# without an active exception", after everything above succeeded: the check is done, so
# the worker leaves without that teardown)
os._exit(0)
