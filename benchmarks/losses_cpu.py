"""``ftopt.losses`` against torch's own losses where they compute the same function, on
the CPU: forward and backward of the loss's mean, median of 10 after 3 warm-ups.

torch's column reduces inside its kernel (``reduction="mean"``); ours returns one loss
per element or example (optax's convention) and then takes ``.mean()``. Prints a
markdown table; writes nothing.

    .venv/bin/python benchmarks/losses_cpu.py [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import ftopt
except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ftopt

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from timing import median_host_ms  # noqa: E402


def backward_of(loss):
    return lambda: loss().backward()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    losses = ftopt.losses
    g = torch.Generator().manual_seed(0)
    b, c = 2048, 8192
    logits = torch.randn(b, c, generator=g, requires_grad=True)
    labels = torch.randint(0, c, (b,), generator=g)
    probs = torch.softmax(torch.randn(b, c, generator=g), -1)
    x = torch.randn(b, 512, generator=g, requires_grad=True)
    y = torch.randn(b, 512, generator=g)
    t, n, k, s = 100, 16, 40, 20
    ctc_logits = torch.randn(n, t, k, generator=g, requires_grad=True)
    ctc_labels = torch.randint(1, k, (n, s), generator=g)
    rows = [
        (f"softmax CE, integer labels ({b}x{c})",
         lambda: losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
         lambda: F.cross_entropy(logits, labels)),
        (f"softmax CE, probabilities ({b}x{c})",
         lambda: losses.softmax_cross_entropy(logits, probs).mean(),
         lambda: F.cross_entropy(logits, probs)),
        (f"sigmoid BCE ({b}x{c})",
         lambda: losses.sigmoid_binary_cross_entropy(logits, probs).mean(),
         lambda: F.binary_cross_entropy_with_logits(logits, probs)),
        (f"huber ({b}x512)", lambda: losses.huber_loss(x, y).mean(),
         lambda: F.huber_loss(x, y)),
        (f"CTC (T={t}, batch {n}, {k} classes, {s} labels)",
         lambda: losses.ctc_loss(ctc_logits, torch.zeros(n, t), ctc_labels,
                                 torch.zeros(n, s)).mean(),
         lambda: F.ctc_loss(ctc_logits.log_softmax(-1).transpose(0, 1), ctc_labels,
                            torch.full((n,), t), torch.full((n,), s), reduction="none").mean()),
    ]
    print(f"| loss, forward + backward, {args.threads} threads | ftopt ms | torch ms | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for name, ours, theirs in rows:
        a, b_ = median_host_ms(backward_of(ours), 10), median_host_ms(backward_of(theirs), 10)
        print(f"| {name} | {a:.2f} | {b_:.2f} | {a / b_:.2f}x |")


if __name__ == "__main__":
    main()
