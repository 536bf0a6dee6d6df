"""The device time of each main and deferred kernel of a settled skip_zeros step, re-run
by hand from its bound launches: alone (back to back), after a one-element add, and
after its own main kernel, and the deferred kernel at an eighth of its grid and at one
program; with each launch's grid, registers, spills and warps, and the flags set (a
flagged block runs its body in the deferred kernel). GPT-2 8-bit Adam, dense gradients
and 90% of the embedding's rows zero (the carve: the others' group and the spanned one),
under torch.profiler (medians of 20; 10 pairs). Settings come from the environment
(``FTOPT_DEFER_WORDS``, ``FTOPT_DEFER_FLAGS_FEW``, ``FTOPT_PDL``).

    python3 benchmarks/deferred_alone_gpu.py
"""
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import gpu_step  # noqa: E402
import timing  # noqa: E402
import torch  # noqa: E402

import ftopt  # noqa: E402
from ftopt.lowering import execute, native  # noqa: E402
from ftopt.lowering.plan import plan_chain  # noqa: E402

SEEN: dict = {}
_launch = execute.PreparedStep.launch


def _seeing(self, scalars, count_pairs, running=()):
    SEEN["scalars"] = scalars  # (the last step's, to re-run its launches with)
    return _launch(self, scalars, count_pairs, running)


execute.PreparedStep.launch = _seeing


def device_us(fn, n: int = 20) -> dict:
    """Median device us of each kernel of ``fn`` (by its place in a call)."""
    for _ in range(3):
        fn()
    events = [e for e in timing.cuda_events(fn, n) if e.device_time > 0]
    by: dict = {}
    for i, e in enumerate(events):
        by.setdefault(f"{e.name[:20]}#{i % max(len(events) // n, 1)}", []).append(
            e.device_time)
    return {k: round(statistics.median(v), 2) for k, v in by.items()}


def _compiled(runner) -> tuple:
    """The compiled kernel and grid a bound launch's runner closes over (Triton's
    ``CompiledKernel.__getitem__``)."""
    cells = [c.cell_contents for c in runner.__closure__ or ()]
    return (next(c for c in cells if hasattr(c, "n_regs")),
            next(c for c in cells if isinstance(c, tuple)))


def described(b) -> str:
    compiled, grid = _compiled(b.runner)
    return (f"grid {grid[0]}, {compiled.n_regs} registers, {compiled.n_spills} spilled, "
            f"{compiled.metadata.num_warps} warps, flags a program "
            f"{b.group.defer_flags or '-'}")


def main() -> None:
    native.module(wait=True)
    cfg = gpu_step.gpt2_tree_config(torch.device("cuda"))
    one = torch.zeros(1, device="cuda")
    for _, kw, _, params, grads in gpu_step.layout_trees(cfg, ["8-bit"]):
        sparse, _ = gpu_step._sparse_wte(grads, cfg)
        for label, g in (("dense", grads), ("sparse", sparse)):
            tx = ftopt.adam(1e-3, skip_zeros=True, **kw)
            step = timing.donated_stepper(tx, params, g)
            for _ in range(30):  # (the watch settled: its carve, its flags a program)
                step()
            torch.cuda.synchronize()
            bound = plan_chain(tx).prepared._bound  # (the last step's mode)
            args = SEEN["scalars"] if bound[0] else (SEEN["scalars"],)
            by_group: dict = {}
            for b in bound[2]:
                by_group.setdefault(id(b.group), []).append(b)
            for launches in by_group.values():
                group = launches[0].group
                print(f"{label}: group of {group.work.num_blocks} blocks, {len(launches)} "
                      f"launches, beside {group.beside}", flush=True)
                for b in launches:
                    print("  launch:", described(b), flush=True)
                runs = [lambda b=b, a=args: b.runner(*b.before, *a, *b.after)
                        for b in launches]
                print("  each alone:", [device_us(r) for r in runs], flush=True)
                if len(runs) == 2:
                    main_run, deferred = runs
                    print("  after a one-element add:",
                          device_us(lambda d=deferred: (one.add_(1.0), d())), flush=True)
                    print("  main then deferred:",
                          device_us(lambda m=main_run, d=deferred: (m(), d()), 10),
                          flush=True)
                    compiled, grid = _compiled(launches[1].runner)
                    b = launches[1]
                    for size in (max(grid[0] // 8, 1), 1):
                        runner = compiled[(size, 1, 1)]
                        print(f"  deferred at a grid of {size}:", device_us(
                            lambda r=runner, b=b, a=args: r(*b.before, *a, *b.after)),
                            flush=True)
                    flags = group.flags
                    print(f"  flags set: {int((flags == 1).sum())} deferred, "
                          f"{int((flags == 2).sum())} all zero, of {flags.numel()}",
                          flush=True)


if __name__ == "__main__":
    main()
