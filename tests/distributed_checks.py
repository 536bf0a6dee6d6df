"""The checks ``tests/test_distributed.py`` runs in two processes (gloo, CPU).

Every rank runs every check; each check returns a dict of measurements, rank 0 writes
them (or the traceback of a check that raised) to ``results.json`` for the test to judge.
The references are single-process runs of the same model on the same full batch, made in
the same process (every rank feeds the full batch, so FSDP2's averaged gradients equal the
reference's bit for bit and the optimizer is what is compared).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from torch.nn.parallel import DistributedDataParallel

import ftopt

STEPS = 20


class Net(torch.nn.Module):
    """An embedding with rows no batch uses (all-zero gradients), an uneven Linear (33
    rows: 17 and 16 per rank, 256 elements a row, so 8-bit blocks align) and a small one."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 256)
        self.fc1 = torch.nn.Linear(256, 33)
        self.fc2 = torch.nn.Linear(33, 5)

    def forward(self, idx):
        return self.fc2(torch.tanh(self.fc1(self.emb(idx))))


def batches(n: int, device="cpu"):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, 10, (16,), generator=g).to(device),
             torch.randn(16, 5, generator=g).to(device)) for _ in range(n)]


def make_models(mesh, device="cpu"):
    torch.manual_seed(0)
    ref = Net().to(device)
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=mesh)
    return model, ref


def loss_of(model, batch):
    idx, target = batch
    return (model(idx) - target).square().mean()


def train(model, tx, data, donate=True, backend="auto", state=None, params=None):
    params = dict(model.named_parameters()) if params is None else params
    state = tx.init(params) if state is None else state
    for batch in data:
        loss_of(model, batch).backward()
        grads = {k: v.grad for k, v in params.items()}
        params, state = ftopt.step(tx, params, grads, state, donate=donate, backend=backend)
        model.zero_grad(set_to_none=True)
    return params, state


def sharded_and_one_process(mesh, make, data, backend: str) -> tuple:
    """``train`` of the FSDP2 model and of its one-process copy, a fresh ``make()`` each:
    ``((params, state), (reference params, reference state))``."""
    model, ref = make_models(mesh)
    return (train(model, make(), data, backend=backend),
            train(ref, make(), data, backend=backend))


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a: dict, b: dict) -> float:
    return max(float((full(a[k]).detach().double() - full(b[k]).detach().double()).abs().max())
               for k in b)


CHAINS = {
    "adamw": lambda: ftopt.adamw(3e-3, weight_decay=0.1),
    "adamw_clip": lambda: ftopt.chain(ftopt.clip_by_global_norm(0.05),
                                      ftopt.adamw(3e-3, weight_decay=0.1)),
    "lamb": lambda: ftopt.lamb(3e-3, weight_decay=0.1),
    "lion": lambda: ftopt.lion(1e-3),
    "adamw_skip_zeros": lambda: ftopt.adamw(3e-3, weight_decay=0.1, skip_zeros=True),
    "adamw_8bit": lambda: ftopt.adamw(3e-3, weight_decay=0.1, state_bits=8),
}


def check_fsdp_chains(mesh, rank):
    out = {}
    data = batches(STEPS)
    for name, make in CHAINS.items():
        model, ref = make_models(mesh)
        start = {k: full(v).clone() for k, v in model.named_parameters()}
        params, state = train(model, make(), data)
        ref_params, ref_state = train(ref, make(), data)
        result = {"max_diff": max_diff(params, ref_params),
                  "moved": max_diff(params, start),
                  "state_is_dtensor": all(isinstance(t, DTensor) for t in
                                          ftopt.tree.leaves(state[0][1])
                                          if t.ndim > 0) if name == "adamw" else True}
        if name == "adamw_skip_zeros":
            rows = full(params["emb.weight"])[10:]
            result["zero_rows_kept"] = bool(torch.equal(rows, start["emb.weight"][10:]))
        if name == "adamw_8bit":
            mu, ref_mu = state[0].mu["fc1.weight"], ref_state[0].mu["fc1.weight"]
            result["is_8bit"] = isinstance(mu, ftopt.rules.QuantizedSlot)
            result["codes_equal"] = bool(torch.equal(full(mu.codes), ref_mu.codes))
            result["absmax_equal"] = bool(torch.equal(full(mu.absmax).reshape(-1),
                                                      ref_mu.absmax))
            result["small_leaf_32bit"] = not isinstance(state[0].mu["fc2.weight"],
                                                        ftopt.rules.QuantizedSlot)
        out[name] = result
    return out


def check_update_and_non_donated(mesh, rank):
    """``donate=False`` leaves the DTensors given untouched; ``tx.update`` gives DTensor
    updates; both match one process."""
    data = batches(1)
    model, ref = make_models(mesh)
    tx = CHAINS["lamb"]()
    out = {}
    for backend in ("eager", "update"):
        params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
        before = {k: full(v).clone() for k, v in params.items()}
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            loss_of(m, data[0]).backward()
        grads = {k: v.grad for k, v in params.items()}
        ref_grads = {k: v.grad for k, v in ref_params.items()}
        if backend == "update":
            new, _ = tx.update(grads, tx.init(params), params)
            want, _ = tx.update(ref_grads, tx.init(ref_params), ref_params)
            out["update_is_dtensor"] = all(isinstance(u, DTensor) for u in new.values())
        else:
            new, _ = ftopt.step(tx, params, grads, tx.init(params))
            want, _ = ftopt.step(tx, ref_params, ref_grads, tx.init(ref_params))
        out[f"{backend}_diff"] = max_diff(new, want)
        out[f"{backend}_inputs_untouched"] = max_diff(params, before) == 0.0
    return out


def check_fused(mesh, rank, device):
    if device is None:
        return {"skipped": "fused kernels need two GPUs or the Triton interpreter"}
    data = batches(3, device)
    out = {}
    for name in ("adamw_clip", "lamb", "adamw_8bit"):
        model, ref = make_models(mesh, device)
        params, state = train(model, CHAINS[name](), data, backend="fused")
        ref_params, ref_state = train(ref, CHAINS[name](), data, backend="fused")
        out[name] = max_diff(params, ref_params)
    return out


def mixed_norm_diff(make, leaves: dict, mesh, backend: str) -> float:
    """Max difference of 3 donated steps of ``make()`` over DTensors laid out as
    ``leaves`` (name -> (param, grad, placements)) against one process."""
    tx, ref_tx = make(), make()
    params = {k: distribute_tensor(p, mesh, pl) for k, (p, _, pl) in leaves.items()}
    ref = {k: p.clone() for k, (p, _, _) in leaves.items()}
    state, ref_state = tx.init(params), ref_tx.init(ref)
    for i in range(3):
        grads = {k: distribute_tensor(g * (i + 1), mesh, pl) for k, (_, g, pl) in leaves.items()}
        params, state = ftopt.step(tx, params, grads, state, donate=True, backend=backend)
        ref, ref_state = ftopt.step(ref_tx, ref, {k: g * (i + 1) for k, (_, g, _) in
                                                  leaves.items()}, ref_state, donate=True,
                                    backend=backend)
    return max_diff(params, ref)


def check_novograd_split(mesh, device):
    """NovoGrad on leaves split over the ranks (uneven Shard(0)): each leaf's norm is
    summed over the mesh, so nu and the params are those of one process, eager and fused;
    with skip_zeros, a leaf whose gradient is zero on one rank only advances its nu, an
    all-zero leaf keeps it."""
    torch.manual_seed(21)
    w_grad = torch.randn(7, 6)
    w_grad[:4] = 0.0  # rank 0's rows of w: all zero, rank 1's are not
    leaves = {"w": (torch.randn(7, 6), w_grad, [Shard(0)]),
              "b": (torch.randn(5), torch.randn(5), [Shard(0)]),
              "z": (torch.randn(5, 3), torch.zeros(5, 3), [Shard(0)])}
    make = lambda: ftopt.novograd(3e-2, b2=0.5, weight_decay=0.1,  # noqa: E731
                                  skip_zeros=True)
    return {backend: mixed_norm_diff(make, leaves, mesh, backend)
            for backend in ("eager",) + (("fused",) if device is not None else ())}


def check_hsdp_and_tensor_parallel(rank, device):
    out = {}
    mesh2 = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    model, ref = make_models(mesh2)
    out["hsdp_placements"] = str(model.fc1.weight.placements)
    data = batches(5)
    params, _ = train(model, CHAINS["lamb"](), data)
    ref_params, _ = train(ref, CHAINS["lamb"](), data)
    out["hsdp_diff"] = max_diff(params, ref_params)
    # Norms (global and per leaf) over a mix of layouts of one mesh equal one process:
    # HSDP leaves with one replicated on both mesh dims; tensor parallel Shard(1) leaves
    # with a replicated one (eager, and fused where kernels run).
    # (sgd: an Adam after the clip would hide a wrong norm's scale.)
    norms = lambda: ftopt.chain(ftopt.clip_by_global_norm(0.1),  # noqa: E731
                                ftopt.clip_by_block_rms(0.05), ftopt.sgd(0.1))
    torch.manual_seed(2)
    hw, hg = torch.randn(6, 4), torch.randn(6, 4)
    out["hsdp_mixed_diff"] = mixed_norm_diff(
        norms, {"w": (hw, hg, [Replicate(), Shard(0)]),
                "b": (hw[0], hg[0], [Replicate(), Replicate()])}, mesh2, "auto")
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(3)
    w, g = torch.randn(6, 10), torch.randn(6, 10)
    tx = ftopt.chain(ftopt.clip_by_global_norm(0.1), ftopt.adamw(1e-2))
    dw = {"w": distribute_tensor(w, mesh, [Shard(1)])}
    new, _ = ftopt.step(tx, dw, {"w": distribute_tensor(g, mesh, [Shard(1)])},
                        tx.init(dw))
    want, _ = ftopt.step(tx, {"w": w}, {"w": g}, tx.init({"w": w}))
    out["tp_shard1_diff"] = float((full(new["w"]) - want["w"]).abs().max())
    leaves = {"w": (w, g, [Shard(1)]), "b": (w[0], g[0], [Replicate()]),
              "c": (w[:, 0], g[:, 0], [Shard(0)])}
    for backend in ("auto",) + (("fused",) if device is not None else ()):
        out[f"tp_mixed_{backend}_diff"] = mixed_norm_diff(norms, leaves, mesh, backend)
    # A plain tensor among DTensors: whose shards it is, is not known: refused.
    mixed = {"w": distribute_tensor(w, mesh, [Shard(1)]),
             "b": distribute_tensor(w[0], mesh, [Replicate()])}
    grads = {"w": distribute_tensor(g, mesh, [Shard(1)]),
             "b": distribute_tensor(g[0], mesh, [Replicate()])}
    with_plain = {"w": mixed["w"], "b": w[0].clone()}
    state = tx.init(with_plain)
    before = full(mixed["w"]).clone()
    try:
        ftopt.step(tx, with_plain, {"w": grads["w"], "b": g[0].clone()}, state, donate=True)
        out["mixed_error"] = None
    except ValueError as err:
        out["mixed_error"] = str(err)
    out["mixed_untouched"] = bool(torch.equal(full(mixed["w"]), before))
    # Elementwise chains need no norm: a mix is fine.
    plain = ftopt.adamw(1e-2)
    new, _ = ftopt.step(plain, mixed, grads, plain.init(mixed))
    want, _ = ftopt.step(plain, {"w": w, "b": w[0]}, {"w": g, "b": g[0]},
                         plain.init({"w": w, "b": w[0]}))
    out["mixed_elementwise_diff"] = max_diff(new, want)
    partial = {"w": DTensor.from_local(g / 2, mesh, [Partial()])}
    try:
        ftopt.step(plain, {"w": distribute_tensor(w, mesh, [Replicate()])}, partial,
                   plain.init({"w": distribute_tensor(w, mesh, [Replicate()])}))
        out["partial_error"] = None
    except ValueError as err:
        out["partial_error"] = str(err)
    # 8-bit on shards that start inside a block: refused at init, naming the layout.
    odd = {"w": distribute_tensor(torch.randn(33, 200), mesh, [Shard(0)])}
    try:
        ftopt.adamw(1e-3, state_bits=8).init(odd)
        out["misaligned_error"] = None
    except ValueError as err:
        out["misaligned_error"] = str(err)
    return out


def check_pointer_guard(mesh, rank, device):
    from ftopt.lowering import checks

    d = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    out = {"data_ptr": d.data_ptr()}
    try:
        checks.refuse_dtensors([torch.zeros(3), d])
        out["error"] = None
    except TypeError as err:
        out["error"] = str(err)
    if device is None:
        return out
    # A cached donated step over plain tensors, then a DTensor gradient for the same
    # leaf: the tables' check (here the Python one, which reads its data_ptr() 0) sends
    # the step to the shards, with the plain step's result.
    torch.manual_seed(7)
    w, g1, g2 = torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4)
    tx = ftopt.adamw(1e-2)
    saved = checks.USE_NATIVE, checks.USE_GUARDS
    checks.USE_NATIVE = checks.USE_GUARDS = False
    try:
        params, state = {"w": w.clone()}, tx.init({"w": w})
        for g in (g1, {"w": distribute_tensor(g2, mesh, [Replicate()])}):
            g = g if isinstance(g, dict) else {"w": g.clone()}
            params, state = ftopt.step(tx, params, g, state, donate=True, backend="fused")
    finally:
        checks.USE_NATIVE, checks.USE_GUARDS = saved
    ref, ref_state = {"w": w.clone()}, tx.init({"w": w})
    for g in (g1, g2):
        ref, ref_state = ftopt.step(tx, ref, {"w": g}, ref_state, backend="eager")
    out["dtensor_grad_diff"] = max_diff(params, ref)
    return out


def check_cached_step(mesh, rank, device):
    """Donated fused steps over the same DTensors take the cached path (no unwrap, the
    same DTensor objects back) and equal one process; a param whose storage was swapped
    and a state leaf replaced by another DTensor send a step to the full path, which
    writes the new tensors."""
    if device is None:
        return {"skipped": "fused kernels need two GPUs or the Triton interpreter"}
    from ftopt import distributed as backend

    full_calls = []
    unwrap = backend._Call.unwrap

    def counting(self, tree, what, **kwargs):
        if what == "params":
            full_calls.append(what)
        return unwrap(self, tree, what, **kwargs)

    data = batches(4, device)
    model, ref = make_models(mesh, device)
    tx = CHAINS["adamw_clip"]()  # a global norm: the cached step all-reduces it
    out = {}
    backend._Call.unwrap = counting
    try:
        params, state = train(model, tx, data[:3], backend="fused")
        out["full_calls"] = len(full_calls)
        leaves = ftopt.tree.leaves(state)
        params, state = train(model, tx, data[3:], backend="fused", state=state,
                              params=params)
        out["same_objects"] = all(a is b for a, b in zip(ftopt.tree.leaves(state), leaves))
        out["same_params"] = all(params[k] is v for k, v in model.named_parameters())
        ref_params, _ = train(ref, CHAINS["adamw_clip"](), data, backend="fused")
        out["diff"] = max_diff(params, ref_params)
        # Swaps, on DTensors of no module (FSDP2 all-gathers from its own storage).
        torch.manual_seed(5)
        w, b, grads = torch.randn(6, 8), torch.randn(5), [torch.randn(6, 8) for _ in range(4)]
        params = {"w": distribute_tensor(w, mesh, [Shard(0)]),
                  "b": distribute_tensor(b, mesh, [Shard(0)])}
        state = tx.init(params)
        ref_tx = CHAINS["adamw_clip"]()  # (a transform's cache holds its last call)
        ref, ref_state = {"w": w.clone(), "b": b.clone()}, ref_tx.init({"w": w, "b": b})
        full_calls.clear()
        for i, g in enumerate(grads):
            if i == 2:  # what FSDP2 does when it reloads a param: new local storage
                params["w"]._local_tensor = params["w"]._local_tensor.clone()
            if i == 3:  # a state leaf replaced by another DTensor (new memory)
                mu = state[1][0].mu
                mu["b"] = mu["b"].clone()
            dg = {"w": distribute_tensor(g, mesh, [Shard(0)]),
                  "b": distribute_tensor(g[0, :5], mesh, [Shard(0)])}
            params, state = ftopt.step(tx, params, dg, state, donate=True, backend="fused")
            ref, ref_state = ftopt.step(ref_tx, ref, {"w": g, "b": g[0, :5]}, ref_state,
                                        donate=True, backend="fused")
        out["swap_full_calls"] = len(full_calls)
        out["swap_diff"] = max_diff(params, ref)
        out["swap_state_diff"] = float((full(state[1][0].mu["b"]) - ref_state[1][0].mu["b"]
                                        ).abs().max())
    finally:
        backend._Call.unwrap = unwrap
    return out

# Adafactor's factored leaves on shards, by how the split meets the factored dims (d1, d0).
FACTORED_LAYOUTS = {
    "w": ((33, 40), [Shard(0)]),  # splits d1, uneven (17 and 16 rows)
    "t": ((40, 12), [Shard(0)]),  # splits d0
    "x": ((6, 10, 4), [Shard(0)]),  # 3-D, splits d1
    "e": ((1, 8), [Shard(0)]),  # splits d1, rank 1 holds no row
    "z": ((1, 6, 10), [Shard(0)]),  # splits neither (rank 1 holds nothing)
    "c": ((6, 10), [Shard(1)]),  # tensor parallel: splits d0
    "b": ((10,), [Shard(0)]),  # unfactored
    "r": ((6, 10), [Replicate()]),
}


def factored_tx():
    # A low clipping threshold, so the update's RMS (summed over the mesh) clips.
    return ftopt.adafactor(1e-2, min_dim_size_to_factor=1, clipping_threshold=0.5,
                           momentum=0.9)


def factored_state(state):
    return next(s for s in state if isinstance(s, ftopt.FactoredState))


def factored_hsdp(start: dict, grads: list) -> dict:
    """HSDP on a (1, 2) mesh, next to a leaf split over both mesh dims: the reducer's
    mixed layouts (a leaf counts once), entries of unequal sizes per leaf."""
    out = {}
    mesh2 = init_device_mesh("cpu", (1, 2))
    hsdp = {"w": [Replicate(), Shard(0)], "t": [Shard(0), Shard(0)],
            "c": [Replicate(), Shard(1)]}
    tx, ref_tx = factored_tx(), factored_tx()
    params = {k: distribute_tensor(start[k].clone(), mesh2, pl) for k, pl in hsdp.items()}
    ref = {k: start[k].clone() for k in hsdp}
    state, ref_state = tx.init(params), ref_tx.init(ref)
    for g in grads:
        params, state = ftopt.step(tx, params, {k: distribute_tensor(g[k], mesh2, pl)
                                                for k, pl in hsdp.items()}, state,
                                   donate=True)
        ref, ref_state = ftopt.step(ref_tx, ref, {k: g[k] for k in hsdp}, ref_state,
                                    donate=True)
    out["hsdp_diff"] = max_diff(params, ref)
    out["hsdp_state_diff"] = max(max_diff(getattr(factored_state(state), name),
                                          getattr(factored_state(ref_state), name))
                                 for name in ("v_row", "v_col"))
    out["hsdp_moved"] = max_diff(params, {k: start[k] for k in hsdp})
    rows, cols = factored_state(state).v_row, factored_state(state).v_col
    out["hsdp_placements"] = str(tuple(rows["t"].placements) + tuple(cols["t"].placements))
    return out


def check_factored(mesh, rank, device, directory):
    """Adafactor on leaves split along one dim of their factored dims or another one
    (uneven, a rank with no row, Shard(1), 3-D, HSDP) equals one process over 12 steps
    (eager; 3 fused where kernels run); the row and column statistics are DTensors, sharded as
    the leaf or replicated; a DCP save, load and resume is bit-exact."""
    torch.manual_seed(6)
    start = {k: torch.randn(shape) for k, (shape, _) in FACTORED_LAYOUTS.items()}
    grads = [{k: torch.randn_like(v) for k, v in start.items()} for _ in range(12)]

    def sharded(tree):
        return {k: distribute_tensor(v.clone(), mesh, FACTORED_LAYOUTS[k][1])
                for k, v in tree.items()}

    def run(tx, params, state, steps, backend, layout=True):
        for g in steps:
            params, state = ftopt.step(tx, params, sharded(g) if layout else g, state,
                                       donate=True, backend=backend)
        return params, state

    out = {}
    for backend, n in (("eager", 12),) + ((("fused", 3),) if device is not None else ()):
        tx, ref_tx = factored_tx(), factored_tx()
        params = sharded(start)
        params, state = run(tx, params, tx.init(params), grads[:n], backend)
        ref = {k: v.clone() for k, v in start.items()}
        ref, ref_state = run(ref_tx, ref, ref_tx.init(ref), grads[:n], backend, False)
        out[f"{backend}_diff"] = max_diff(params, ref)
        out[f"{backend}_moved"] = max_diff(params, start)
        got, want = factored_state(state), factored_state(ref_state)
        out[f"{backend}_state_diff"] = max(max_diff(getattr(got, name), getattr(want, name))
                                          for name in ("v_row", "v_col"))
    rows, cols = factored_state(state).v_row, factored_state(state).v_col
    out["placements"] = {k: [str(tuple(rows[k].placements)), str(tuple(cols[k].placements))]
                         for k in ("w", "t", "c") if isinstance(rows[k], DTensor)}
    out.update(factored_hsdp(start, grads[:4]))
    # tx.update, the factored leaves in a partition (its inner calls see the tree's paths).
    labels = {k: "a" if k == "b" else "f" for k in start}
    tx, ref_tx = (ftopt.partition({"f": factored_tx(), "a": ftopt.adam(1e-2)}, labels)
                  for _ in range(2))
    params = sharded(start)
    updates, _ = tx.update(sharded(grads[0]), tx.init(params), params)
    want, _ = ref_tx.update(grads[0], ref_tx.init(start), start)
    out["partition_update"] = max_diff(updates, want)
    # DCP: save after 6 steps, resume a fresh state from it.
    tx = factored_tx()
    params = sharded(start)
    params, state = run(tx, params, tx.init(params), grads[:6], "eager")
    path = os.path.join(directory, "dcp_factored")
    dcp.save({"opt": ftopt.state_dict(state, tx, params), "model": params},
             checkpoint_id=path)
    end, _ = run(tx, params, state, grads[6:], "eager")
    params2 = sharded({k: torch.zeros_like(v) for k, v in start.items()})
    state2 = tx.init(params2)
    sd = {"opt": ftopt.state_dict(state2, tx, params2), "model": params2}
    dcp.load(sd, checkpoint_id=path)
    state2 = ftopt.load_state_dict(state2, tx, params2, sd["opt"])
    end2, _ = run(tx, params2, state2, grads[6:], "eager")
    out["resumed_diff"] = max_diff(end2, end)
    return out


def check_ddp(rank):
    torch.manual_seed(0)
    net = Net()
    ddp = DistributedDataParallel(net)
    data = batches(STEPS)
    tx = CHAINS["adamw_clip"]()
    params = dict(net.named_parameters())
    state = tx.init(params)
    for batch in data:
        loss_of(ddp, batch).backward()
        params, state = ftopt.step(tx, params, {k: v.grad for k, v in params.items()},
                                   state, donate=True)
        ddp.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in params.values()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    return {"replicas_equal": bool(torch.equal(gathered[0], gathered[1]))}


# States with 0-d tensors: a step count only (noisy_sgd), running scalars
# (schedule_free), one 0-d second moment per leaf (novograd).
SCALAR_CHAINS = {
    "noisy_sgd": lambda: ftopt.noisy_sgd(3e-2, eta=0.01, seed=3),
    "schedule_free": lambda: ftopt.schedule_free_adamw(3e-3, warmup_steps=2),
    "novograd": lambda: ftopt.novograd(3e-3, weight_decay=0.1),
}


def check_dcp_scalars(mesh, rank, directory):
    """DCP of states with 0-d tensors across numbers of ranks: two ranks save (the test
    loads it in one process, :func:`test_dcp_loads_on_one_process`); a one-process
    checkpoint (written by rank 0 alone) loads on two ranks and resumes as the one
    process does, bit for bit. Uneven Shard(0) leaves (novograd, which reads whole
    leaves: Replicate)."""
    torch.manual_seed(10)
    start = {"w": torch.randn(5, 6), "b": torch.randn(7)}
    grads = [{k: torch.randn_like(v) for k, v in start.items()} for _ in range(6)]

    def run(tx, params, state, steps, layout=None):
        for g in steps:
            if layout is not None:
                g = {k: distribute_tensor(v, mesh, layout) for k, v in g.items()}
            params, state = ftopt.step(tx, params, g, state, donate=True)
        return params, state

    out = {}
    for name, make in SCALAR_CHAINS.items():
        layout = [Replicate()] if name == "novograd" else [Shard(0)]

        def sharded(layout=layout):
            return {k: distribute_tensor(v.clone(), mesh, layout) for k, v in start.items()}

        tx, ref_tx = make(), make()
        params = sharded()
        params, state = run(tx, params, tx.init(params), grads[:3], layout)
        ref = {k: v.clone() for k, v in start.items()}
        ref, ref_state = run(ref_tx, ref, ref_tx.init(ref), grads[:3])
        out[f"{name}_diff"] = max_diff(params, ref)
        dcp.save({"opt": ftopt.state_dict(state, tx, params), "model": params},
                 checkpoint_id=os.path.join(directory, f"dcp_{name}"))
        one = os.path.join(directory, f"dcp_one_{name}")
        if rank == 0:
            torch.save({"params": ref, "state": ref_state},
                       os.path.join(directory, f"ref_{name}.pt"))
            dcp.save({"opt": ftopt.state_dict(ref_state, ref_tx, ref), "model": ref},
                     checkpoint_id=one, no_dist=True)
        dist.barrier()
        # The one-process checkpoint, loaded on two ranks into fresh DTensor states.
        tx2 = make()
        params2 = sharded()
        state2 = tx2.init(params2)
        sd = {"opt": ftopt.state_dict(state2, tx2, params2), "model": params2}
        dcp.load(sd, checkpoint_id=one)
        state2 = ftopt.load_state_dict(state2, tx2, params2, sd["opt"])
        got, want = ftopt.tree.leaves(state2), ftopt.tree.leaves(ref_state)
        out[f"{name}_state_loaded"] = len(got) == len(want) and all(
            torch.equal(full(a), b) for a, b in zip(got, want))
        out[f"{name}_scalars"] = sum(t.ndim == 0 for t in want)
        end2, _ = run(tx2, params2, state2, grads[3:], layout)
        ref_end, _ = run(ref_tx, ref, ref_state, grads[3:])
        out[f"{name}_resumed_diff"] = max_diff(end2, ref_end)
    return out


def check_dcp(mesh, rank, directory):
    out = {}
    data = batches(2 * 5)
    for name in ("adamw", "adamw_8bit"):
        path = os.path.join(directory, f"dcp_{name}")
        model, ref = make_models(mesh)
        tx = CHAINS[name]()
        params, state = train(model, tx, data[:5])
        ref_params, ref_state = train(ref, tx, data[:5])
        dcp.save({"opt": ftopt.state_dict(state, tx, params),
                  "model": {k: v.detach() for k, v in params.items()}},
                 checkpoint_id=path)
        if rank == 0:
            torch.save({"params": {k: v.detach() for k, v in ref_params.items()},
                        "state": ref_state}, os.path.join(directory, f"ref_{name}.pt"))
        saved = {k: full(v).clone() for k, v in params.items()}
        end, _ = train(model, tx, data[5:], state=state, params=params)
        end = {k: full(v).clone() for k, v in end.items()}
        # Resume: fresh model and state, both loaded from the checkpoint.
        model2, _ = make_models(mesh)
        params2 = dict(model2.named_parameters())
        state2 = tx.init(params2)
        sd = {"opt": ftopt.state_dict(state2, tx, params2),
              "model": {k: v.detach() for k, v in params2.items()}}
        dcp.load(sd, checkpoint_id=path)
        state2 = ftopt.load_state_dict(state2, tx, params2, sd["opt"])
        out[f"{name}_params_loaded"] = max_diff(params2, saved) == 0.0
        end2, _ = train(model2, tx, data[5:], state=state2, params=params2)
        out[f"{name}_resumed_diff"] = max_diff(end2, end)
    return out


def check_optimizer(mesh, rank, directory):
    """``ftopt.Optimizer`` over an FSDP2 model: a few steps equal one process; its
    ``state_dict`` holds DTensors; a DCP round trip through torch's
    ``get_optimizer_state_dict``/``set_optimizer_state_dict`` resumes bit-exactly."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def make(model):
        return ftopt.Optimizer(model.named_parameters(), ftopt.adamw, lr=3e-3,
                               weight_decay=0.1)

    def run_steps(model, opt, data):
        for batch in data:
            loss_of(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    data = batches(8)
    model, ref = make_models(mesh)
    opt, ref_opt = make(model), make(ref)
    run_steps(model, opt, data[:4])
    run_steps(ref, ref_opt, data[:4])
    params = {k: full(v).clone() for k, v in model.named_parameters()}
    out = {"diff": max_diff(params, dict(ref.named_parameters()))}
    saved = opt.state_dict()["state"]
    kinds = [isinstance(t, DTensor) for slots in saved.values() for t in slots.values()
             if t.ndim > 0]
    out["state_is_dtensor"] = bool(kinds) and all(kinds)
    path = os.path.join(directory, "dcp_optimizer")
    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    run_steps(model, opt, data[4:])
    model2, _ = make_models(mesh)
    opt2 = make(model2)
    sd = {"model": get_model_state_dict(model2),
          "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model2, sd["model"])
    set_optimizer_state_dict(model2, opt2, sd["optim"])
    out["loaded_diff"] = max_diff(dict(model2.named_parameters()), params)
    run_steps(model2, opt2, data[4:])
    out["resumed_diff"] = max_diff(dict(model2.named_parameters()),
                                   dict(model.named_parameters()))
    return out


def check_matrix_stages(mesh, rank, device):
    """Per-row matrix stages on FSDP2's Shard(0) leaves equal one process (and
    adaptive_grad_clip's whole-leaf units, the biases, whose norms are summed over the
    ranks); a split they read across is refused before anything is written, naming the
    leaf."""
    out = {}
    row_chain = lambda: ftopt.chain(  # noqa: E731
        ftopt.adaptive_grad_clip(0.02), ftopt.centralize(), ftopt.scale_by_row_norm(),
        ftopt.adamw(3e-3, weight_decay=0.1))
    data = batches(3)
    for backend in ("eager",) + (("fused",) if device is not None else ()):
        (params, _), (ref_params, _) = sharded_and_one_process(mesh, row_chain, data,
                                                               backend)
        out[f"rows_{backend}_diff"] = max_diff(params, ref_params)
    torch.manual_seed(4)
    w, g = torch.randn(6, 10), torch.randn(6, 10)
    cases = {"shard1": (row_chain, [Shard(1)]),
             # Newton-Schulz reads the whole leaf.
             "muon": (lambda: ftopt.chain(ftopt.scale_by_muon(ns_dtype=torch.float32),
                                          ftopt.scale_by_learning_rate(1e-2)), [Shard(0)])}
    for name, (make, placements) in cases.items():
        for backend in ("eager",) + (("fused",) if device is not None else ()):
            tx = make()
            params = {"w": distribute_tensor(w, mesh, placements)}
            state = tx.init(params)
            before = [full(t).clone() for t in ftopt.tree.leaves((params, state))]
            try:
                ftopt.step(tx, params, {"w": distribute_tensor(g, mesh, placements)}, state,
                           donate=True, backend=backend)
                out[f"{name}_{backend}_error"] = None
            except ValueError as err:
                out[f"{name}_{backend}_error"] = str(err)
            after = [full(t) for t in ftopt.tree.leaves((params, state))]
            out[f"{name}_{backend}_untouched"] = all(
                torch.equal(a, b) for a, b in zip(before, after))
    # Unsplit (Replicate) leaves: any matrix stage runs.
    tx = cases["muon"][0]()
    rep = {"w": distribute_tensor(w, mesh, [Replicate()])}
    new, _ = ftopt.step(tx, rep, {"w": distribute_tensor(g, mesh, [Replicate()])},
                        tx.init(rep))
    want, _ = ftopt.step(tx, {"w": w}, {"w": g}, tx.init({"w": w}))
    out["replicate_diff"] = max_diff(new, want)
    # Muon over a stack of experts (E, in, out), its expert axis a batch axis: FSDP2's
    # Shard(0) gives each rank whole matrices (one process's step); Shard(1) splits them.
    experts = lambda: ftopt.chain(  # noqa: E731
        ftopt.scale_by_muon(ns_dtype=torch.float32,
                            weight_dimension_numbers=ftopt.MuonDimensionNumbers(1, 2)),
        ftopt.scale_by_shape(weight_dimension_numbers=ftopt.MuonDimensionNumbers(1, 2)),
        ftopt.scale_by_learning_rate(1e-2))
    e, ge = torch.randn(4, 6, 5), torch.randn(4, 6, 5)
    for backend in ("eager",) + (("fused",) if device is not None else ()):
        tx = experts()
        sh = {"w": distribute_tensor(e, mesh, [Shard(0)])}
        new, _ = ftopt.step(tx, sh, {"w": distribute_tensor(ge, mesh, [Shard(0)])},
                            tx.init(sh), backend=backend)
        want, _ = ftopt.step(tx, {"w": e}, {"w": ge}, tx.init({"w": e}))
        out[f"experts_{backend}_diff"] = max_diff(new, want)
        sh = {"w": distribute_tensor(e, mesh, [Shard(1)])}
        state = tx.init(sh)
        before = [full(t).clone() for t in ftopt.tree.leaves((sh, state))]
        try:
            ftopt.step(tx, sh, {"w": distribute_tensor(ge, mesh, [Shard(1)])}, state,
                       donate=True, backend=backend)
            out[f"experts_split_{backend}"] = None
        except ValueError as err:
            out[f"experts_split_{backend}"] = str(err)
        out[f"experts_split_{backend}_untouched"] = all(
            torch.equal(a, b) for a, b in zip(before, [full(t) for t in ftopt.tree.leaves(
                (sh, state))]))
    # NorMuon's row moments are not sharded: replicated leaves step as one process does, a
    # split leaf is refused when the state is made, naming it.
    normuon = lambda: ftopt.chain(  # noqa: E731
        ftopt.scale_by_normuon(ns_dtype=torch.float32), ftopt.scale_by_learning_rate(1e-2))
    tx = normuon()
    new, _ = ftopt.step(tx, rep, {"w": distribute_tensor(g, mesh, [Replicate()])},
                        tx.init(rep))
    want, _ = ftopt.step(tx, {"w": w}, {"w": g}, tx.init({"w": w}))
    out["normuon_replicate_diff"] = max_diff(new, want)
    try:
        tx.init({"w": distribute_tensor(w, mesh, [Shard(0)])})
        out["normuon_split"] = None
    except ValueError as err:
        out["normuon_split"] = str(err)
    # SOAP likewise (its factors and rotations read the whole leaf).
    tx = ftopt.soap(1e-2, precondition_frequency=1)
    new, state = ftopt.step(tx, rep, {"w": distribute_tensor(g, mesh, [Replicate()])},
                            tx.init(rep))
    new, _ = ftopt.step(tx, new, {"w": distribute_tensor(w, mesh, [Replicate()])}, state)
    want, state = ftopt.step(tx, {"w": w}, {"w": g}, tx.init({"w": w}))
    want, _ = ftopt.step(tx, want, {"w": w}, state)
    out["soap_replicate_diff"] = max_diff(new, want)
    try:
        tx.init({"w": distribute_tensor(w, mesh, [Shard(0)])})
        out["soap_split"] = None
    except ValueError as err:
        out["soap_split"] = str(err)
    # clip_by_block_rms is element-wise with a per-leaf norm (summed over the mesh): any
    # split is fine.
    tx = ftopt.chain(ftopt.clip_by_block_rms(0.1), ftopt.adam(1e-2))
    sh = {"w": distribute_tensor(w, mesh, [Shard(0)])}
    new, _ = ftopt.step(tx, sh, {"w": distribute_tensor(g, mesh, [Shard(0)])}, tx.init(sh))
    want, _ = ftopt.step(tx, {"w": w}, {"w": g}, tx.init({"w": w}))
    out["block_rms_sharded_diff"] = max_diff(new, want)
    return out


def check_monitor(mesh, rank, device):
    """snapshot and monitor on FSDP2's Shard(0) leaves measure the whole tree, as one
    process does (eager and fused): a norm of every leaf, a per-element copy of the
    embedding's update, an average of whether the norm exceeds the clip; the params step
    as there."""
    out = {}

    def make():
        return ftopt.chain(
            ftopt.adamw(3e-3, weight_decay=0.1),
            ftopt.monitor({"norm": ftopt.tree.norm, "large": ftopt.measure_with_ema(
                lambda u: ftopt.tree.norm(u) > 0.02, 0.9)}),
            ftopt.snapshot("emb", lambda u: u["emb.weight"].clone()),
            ftopt.clip_by_global_norm(0.02))
    data = batches(3)
    for backend in ("eager",) + (("fused",) if device is not None else ()):
        (params, state), (ref_params, ref_state) = sharded_and_one_process(mesh, make, data,
                                                                           backend)
        out[f"{backend}_params_diff"] = max_diff(params, ref_params)
        for name in ("norm", "large", "emb"):
            got, want = ftopt.tree.get(state, name), ftopt.tree.get(ref_state, name)
            out[f"{backend}_{name}_diff"] = float((full(got).double() - want.double())
                                                  .abs().max())
        out[f"{backend}_norm"] = float(full(ftopt.tree.get(ref_state, "norm")))
        # Non-donated steps (the params kept): from the second on through the call cache.
        model, ref = make_models(mesh)
        states = []
        for net in (model, ref):
            tx, params = make(), dict(net.named_parameters())
            state = tx.init(params)
            for batch in data:
                loss_of(net, batch).backward()
                grads = {k: v.grad for k, v in params.items()}
                with torch.no_grad():  # (params that require grad: else a differentiable step)
                    _, state = ftopt.step(tx, params, grads, state, donate=False,
                                          backend=backend)
                net.zero_grad(set_to_none=True)
            states.append(state)
        for name in ("norm", "large", "emb"):
            got, want = (ftopt.tree.get(st, name) for st in states)
            out[f"{backend}_kept_{name}_diff"] = float((full(got).double() - want.double())
                                                       .abs().max())
    return out


def check_call_cache(mesh, rank, device):
    """Non-donated steps and ``tx.update`` over the same DTensor trees unwrap and rewrap
    through the cache after the first call: new DTensors on the given leaves' specs, the
    inputs untouched, equal to one process (8-bit states and a global norm too); trees
    laid out otherwise take the full path."""
    from ftopt import distributed as backend

    full_calls = []
    unwrap = backend._Call.unwrap

    def counting(self, tree, what, **kwargs):
        if what in ("grads", "updates"):
            full_calls.append(what)
        return unwrap(self, tree, what, **kwargs)

    torch.manual_seed(9)
    # 33 rows of 256 (8-bit blocks align: 17 and 16 rows), a vector (3 and 2).
    w, b = torch.randn(33, 256), torch.randn(5)
    grads = [(torch.randn(33, 256), torch.randn(5)) for _ in range(3)]
    make = lambda: ftopt.chain(ftopt.clip_by_global_norm(1.0),  # noqa: E731
                               ftopt.adamw(1e-2, state_bits=8))
    out = {}
    backend._Call.unwrap = counting
    try:
        for name in ("auto",) + (("fused",) if device is not None else ()):
            for kind in ("step", "update"):
                tx, ref_tx = make(), make()
                layout = [Shard(0)]
                params = {"w": distribute_tensor(w, mesh, layout),
                          "b": distribute_tensor(b, mesh, layout)}
                first = {k: full(v).clone() for k, v in params.items()}
                ref = {"w": w.clone(), "b": b.clone()}
                state, ref_state = tx.init(params), ref_tx.init(ref)
                first_state = [full(t).clone() for t in ftopt.tree.leaves(state)]
                given = params, state
                full_calls.clear()
                diffs, dtensors = [], []
                for gw, gb in grads:
                    dg = {"w": distribute_tensor(gw, mesh, layout),
                          "b": distribute_tensor(gb, mesh, layout)}
                    if kind == "step":
                        params, state = ftopt.step(tx, params, dg, state, backend=name)
                        ref, ref_state = ftopt.step(ref_tx, ref, {"w": gw, "b": gb},
                                                    ref_state, backend=name)
                        diffs.append(max_diff(params, ref))
                        new = params
                    else:
                        new, state = tx.update(dg, state, params, backend=name)
                        want, ref_state = ref_tx.update({"w": gw, "b": gb}, ref_state, ref,
                                                        backend=name)
                        diffs.append(max_diff(new, want))
                    dtensors.append(all(isinstance(x, DTensor) and x.placements ==
                                        tuple(layout) for x in new.values()))
                key = f"{kind}_{name}"
                out[f"{key}_full_calls"] = len(full_calls)
                out[f"{key}_diff"] = max(diffs)
                out[f"{key}_dtensors"] = all(dtensors)
                mu = state[1][0].mu["w"]
                out[f"{key}_8bit"] = (isinstance(mu, ftopt.rules.QuantizedSlot)
                                      and isinstance(mu.absmax, DTensor))
                out[f"{key}_state_diff"] = max(
                    float((full(a).double().reshape(-1) - b.double().reshape(-1)).abs().max())
                    for a, b in zip(ftopt.tree.leaves(state), ftopt.tree.leaves(ref_state)))
                out[f"{key}_untouched"] = max_diff(given[0], first) == 0.0 and all(
                    torch.equal(full(a), b) for a, b in
                    zip(ftopt.tree.leaves(given[1]), first_state))
        # Another layout of the same shapes (Replicate): the full path, then its cache.
        tx = make()
        rep = {"w": distribute_tensor(w, mesh, [Replicate()]),
               "b": distribute_tensor(b, mesh, [Replicate()])}
        rep_state = tx.init(rep)
        full_calls.clear()
        for layout in ([Shard(0)], [Replicate()], [Replicate()]):
            p = {"w": distribute_tensor(w, mesh, layout), "b": distribute_tensor(b, mesh,
                                                                                 layout)}
            s = tx.init(p) if layout == [Shard(0)] else rep_state
            new, _ = ftopt.step(tx, p, {"w": distribute_tensor(grads[0][0], mesh, layout),
                                        "b": distribute_tensor(grads[0][1], mesh, layout)},
                                s)
        want, _ = ftopt.step(make(), {"w": w, "b": b}, {"w": grads[0][0], "b": grads[0][1]},
                             make().init({"w": w, "b": b}))
        out["relayout_full_calls"] = len(full_calls)
        out["relayout_diff"] = max_diff(new, want)
    finally:
        backend._Call.unwrap = unwrap
    return out


def check_noise(rank, device, make=None):
    """``noisy_sgd`` on shards draws the single process's noise, bit for bit: an
    element's position is the one in the full tensor (uneven Shard(0) on one mesh dim and
    on both of a 2-D mesh, HSDP, Replicate), eager, fused and through ``tx.update``; a
    leaf split on dim 1 is refused before anything is written, naming it. ``make``: another
    transform that hashes element positions (stochastic rounding of bf16 states)."""
    torch.manual_seed(8)
    # fc-like (5 rows over 2 ranks: 3 and 2), a vector (7: 4 and 3), a replicated leaf.
    full_params = {"w": torch.randn(5, 6), "v": torch.randn(7), "r": torch.randn(3, 2)}
    grads = [{k: torch.randn_like(p) for k, p in full_params.items()} for _ in range(3)]
    mesh = init_device_mesh("cpu", (2,))
    mesh2 = init_device_mesh("cpu", (1, 2))
    layouts = {
        "shard0": (mesh, {"w": [Shard(0)], "v": [Shard(0)], "r": [Replicate()]}),
        "hsdp": (mesh2, {"w": [Replicate(), Shard(0)], "v": [Shard(0), Shard(0)],
                         "r": [Replicate(), Replicate()]}),
    }
    make = make or (lambda: ftopt.noisy_sgd(0.1, eta=1.0, seed=11))
    out = {}
    for backend in ("eager",) + (("fused",) if device is not None else ()):
        ref_tx = make()
        ref, ref_state = dict(full_params), ref_tx.init(full_params)
        ref_updates = []
        for g in grads:
            ref_updates.append(ref_tx.update(g, ref_state, ref)[0])
            ref, ref_state = ftopt.step(ref_tx, ref, g, ref_state, backend=backend)
        for name, (m, placements) in layouts.items():
            tx = make()
            params = {k: distribute_tensor(p.clone(), m, placements[k]) for k, p in
                      full_params.items()}
            state = tx.init(params)
            for i, g in enumerate(grads):
                dg = {k: distribute_tensor(x, m, placements[k]) for k, x in g.items()}
                if i == 0 and backend == "eager":
                    updates, _ = tx.update(dg, state, params)
                    out[f"{name}_update_diff"] = max_diff(updates, ref_updates[0])
                params, state = ftopt.step(tx, params, dg, state, donate=True,
                                           backend=backend)
            out[f"{name}_{backend}_diff"] = max_diff(params, ref)
        # Shard(1) splits rows: refused, nothing written.
        tx = make()
        params = {"w": distribute_tensor(full_params["w"].clone(), mesh, [Shard(1)])}
        state = tx.init(params)
        before = full(params["w"]).clone()
        try:
            ftopt.step(tx, params, {"w": distribute_tensor(grads[0]["w"], mesh, [Shard(1)])},
                       state, donate=True, backend=backend)
            out[f"shard1_{backend}_error"] = None
        except ValueError as err:
            out[f"shard1_{backend}_error"] = str(err)
        out[f"shard1_{backend}_untouched"] = bool(torch.equal(full(params["w"]), before))
        out[f"shard1_{backend}_count"] = int(state[0].count)
    return out


def run(rank: int, world: int, directory: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    fused_device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None
    checks = {
        "fsdp_chains": lambda: check_fsdp_chains(mesh, rank),
        "update_and_non_donated": lambda: check_update_and_non_donated(mesh, rank),
        "fused": lambda: check_fused(mesh, rank, fused_device),
        "hsdp_and_tensor_parallel": lambda: check_hsdp_and_tensor_parallel(rank,
                                                                           fused_device),
        "pointer_guard": lambda: check_pointer_guard(mesh, rank, fused_device),
        "cached_step": lambda: check_cached_step(mesh, rank, fused_device),
        "factored": lambda: check_factored(mesh, rank, fused_device, directory),
        "ddp": lambda: check_ddp(rank),
        "dcp": lambda: check_dcp(mesh, rank, directory),
        "optimizer": lambda: check_optimizer(mesh, rank, directory),
        "matrix_stages": lambda: check_matrix_stages(mesh, rank, fused_device),
        "monitor": lambda: check_monitor(mesh, rank, fused_device),
        "noise": lambda: check_noise(rank, fused_device),
        "stochastic_rounding": lambda: check_noise(rank, fused_device, lambda: ftopt.adamw(
            0.1, state_dtype=torch.bfloat16, state_rounding="stochastic")),
        "call_cache": lambda: check_call_cache(mesh, rank, fused_device),
        "dcp_scalars": lambda: check_dcp_scalars(mesh, rank, directory),
        "novograd_split": lambda: check_novograd_split(mesh, fused_device),
    }
    results = {}
    # Where a rank dies (a signal, not an exception), the test names the check it was in.
    with open(os.path.join(directory, f"progress_{rank}.log"), "a") as progress:
        for name, check in checks.items():
            print(f"{time.monotonic():.3f} start {name}", file=progress, flush=True)
            try:
                results[name] = check()
            except Exception:  # reported to the test, which fails naming it
                results[name] = {"raised": traceback.format_exc()}
            print(f"{time.monotonic():.3f} done {name}", file=progress, flush=True)
        if rank == 0:
            with open(os.path.join(directory, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
        dist.barrier()
        print(f"{time.monotonic():.3f} barrier", file=progress, flush=True)
        dist.destroy_process_group()
        print(f"{time.monotonic():.3f} destroyed", file=progress, flush=True)
    # Every check has finished and its results are written: leave without the
    # interpreter's teardown, where once (CI, 2026-12-06) a rank aborted after destroying
    # its process group ("terminate called without an active exception": a C++ thread of
    # torch's still joinable at exit).
    os._exit(0)
