"""``ftopt.Optimizer`` on a GPU: the checks the CPU tests make in the Triton interpreter,
on the real fused path (``backend="auto"``), and the cost of a step.

* against ``torch.optim.AdamW`` under ``OneCycleLR`` (relative error), with no kernel
  compiled after the first steps while the scheduler writes ``lr`` and ``betas``;
* ``backend="auto"`` equal to ``backend="fused"`` (it fused);
* bit-exact resume through ``torch.save``/``torch.load(map_location="cpu")``, 32-bit and
  8-bit states;
* a ``torch.amp.GradScaler`` loop under fp16 autocast;
* ms per step over 24 1024x1024 fp32 params: ``ftopt.Optimizer`` (live hyperparameter
  tensors), a bare donated ``ftopt.step`` (float hyperparameters), torch's fused and
  foreach AdamW.

    python benchmarks/optimizer_gpu.py
    TRITON_INTERPRET=1 python benchmarks/optimizer_gpu.py --device cpu --small  # smoke

Prints the results; a failed check raises.
"""

from __future__ import annotations

import argparse
import io
import time

import torch

import ftopt
from ftopt.lowering import kernel_files


def _model(device, width):
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, width),
        torch.nn.GELU(), torch.nn.Linear(width, 1)).to(device)


def _train(model, opt, batches, sched=None):
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()


def _equal(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def checks(device, width, batches, backend):
    ours, theirs = _model(device, width), _model(device, width)
    params = dict(ours.named_parameters())
    print(ftopt.explain(ftopt.adamw(1e-3), params, donate=True, backend=backend,
                        file=io.StringIO()))
    opt = ftopt.Optimizer(params.items(), ftopt.adamw, lr=1e-3, weight_decay=0.1,
                          backend=backend)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3, weight_decay=0.1)
    s1, s2 = (torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=len(batches))
              for o in (opt, ref))
    _train(ours, opt, batches[:2], s1)
    _train(theirs, ref, batches[:2], s2)
    modules = len(kernel_files._MODULES)
    _train(ours, opt, batches[2:], s1)
    _train(theirs, ref, batches[2:], s2)
    assert len(kernel_files._MODULES) == modules, "a kernel was compiled after the first steps"
    err = max(((p - q).abs().max() / q.abs().max()).item()
              for p, q in zip(ours.parameters(), theirs.parameters()))
    print(f"vs torch AdamW under OneCycleLR: max relative error {err:.2e}")
    assert err < 1e-4
    forced = _model(device, width)
    opt = ftopt.Optimizer(forced.named_parameters(), ftopt.adamw, lr=1e-3,
                          weight_decay=0.1, backend="fused")
    _train(forced, opt, batches,
           torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=len(batches)))
    assert _equal(forced, ours), "backend='auto' did not run the fused kernels"
    for bits in (32, 8):
        def fresh(bits=bits):
            m = _model(device, width)
            o = ftopt.Optimizer(m.named_parameters(), ftopt.adamw, lr=1e-3,
                                weight_decay=0.1, state_bits=bits, backend=backend)
            return m, o, torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=len(batches))
        straight, o1, sch1 = fresh()
        _train(straight, o1, batches, sch1)
        first, o2, sch2 = fresh()
        _train(first, o2, batches[:10], sch2)
        buffer = io.BytesIO()
        torch.save({"m": first.state_dict(), "o": o2.state_dict(), "s": sch2.state_dict()},
                   buffer)
        buffer.seek(0)
        saved = torch.load(buffer, map_location="cpu", weights_only=True)
        resumed, o3, sch3 = fresh()
        resumed.load_state_dict(saved["m"])
        o3.load_state_dict(saved["o"])
        sch3.load_state_dict(saved["s"])
        _train(resumed, o3, batches[10:], sch3)
        assert _equal(resumed, straight), f"{bits}-bit resume is not bit-exact"
        print(f"{bits}-bit resume bit-exact; state of a weight: "
              f"{sorted(o3.state[resumed[2].weight])}")


def grad_scaler(device, width, batches):
    model = _model(device, width)
    opt = ftopt.Optimizer(model.parameters(), ftopt.adam, lr=1e-3)
    scaler = torch.amp.GradScaler(device.type)
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    for x, y in batches[:5]:
        opt.zero_grad()
        with torch.autocast(device.type, dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    print(f"GradScaler: {int(opt.state[model[0].weight]['step'])} steps, scale "
          f"{scaler.get_scale()}")


def timings(device, n, size):
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(size, size, device=device)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)

    def bench(step, iters=50):
        for _ in range(5):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / iters * 1e3

    opt = ftopt.Optimizer(params, ftopt.adamw, lr=1e-3, weight_decay=0.1)
    print(f"ftopt.Optimizer: {bench(opt.step):.3f} ms/step")
    tx = ftopt.adamw(1e-3, weight_decay=0.1)
    box = [tx.init(params)]
    grads = [p.grad for p in params]

    def bare():
        _, box[0] = ftopt.step(tx, params, grads, box[0], donate=True)

    print(f"bare donated ftopt.step: {bench(bare):.3f} ms/step")
    for kind in ("fused", "foreach"):
        if kind == "fused" and device.type != "cuda":
            continue
        ref = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **{kind: True})
        print(f"torch AdamW({kind}=True): {bench(ref.step):.3f} ms/step")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a quick CPU-sized run")
    args = parser.parse_args()
    device = torch.device(args.device)
    width = 64 if args.small else 1024
    gen = torch.Generator(device=device).manual_seed(2)
    batches = [(torch.randn(128, 64, device=device, generator=gen),
                torch.randn(128, 1, device=device, generator=gen)) for _ in range(30)]
    backend = "fused" if device.type == "cpu" else "auto"
    checks(device, width, batches, backend)
    grad_scaler(device, width, batches)
    timings(device, 4 if args.small else 24, 64 if args.small else 1024)


if __name__ == "__main__":
    main()
