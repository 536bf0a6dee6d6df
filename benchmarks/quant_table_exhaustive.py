"""Every one of the 2**32 float32 bit patterns through both dynamic maps' bucket tables
(:func:`ftopt.quant.nearest_code`) against the binary search (``_searched_code``), and the
two encoders' times on 4M random values. Prints the mismatches (0 expected) per map and
writes ``OUT`` (JSON).

    python benchmarks/quant_table_exhaustive.py [OUT] [--chunk-bits=26]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import median_host_ms  # noqa: E402

from ftopt import quant  # noqa: E402


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    chunk = 1 << int(opts.get("chunk-bits", 26))
    out = {"threads": torch.get_num_threads()}
    g = torch.Generator().manual_seed(0)
    v = torch.rand(4_000_000, generator=g) * 2 - 1
    for signed in (True, False):
        qmap = quant.dynamic_map(signed)
        bits = quant._bucket_table(qmap)[0]
        t0, mismatches = time.perf_counter(), 0
        for s in range(0, 1 << 32, chunk):
            x = quant._as_float(torch.arange(s, s + chunk, dtype=torch.int64))
            got = quant.nearest_code(x, qmap)
            want = quant._searched_code(x, qmap).to(torch.uint8)
            mismatches += int((got != want).sum())
        name = "signed" if signed else "unsigned"
        searched = median_host_ms(lambda q=qmap: quant._searched_code(v, q), 5)
        table = median_host_ms(lambda q=qmap: quant.nearest_code(v, q), 5)
        out[name] = {"bits": bits, "patterns": 1 << 32, "mismatches": mismatches,
                     "seconds": round(time.perf_counter() - t0, 1),
                     "searched_ms_4M": round(searched, 2), "table_ms_4M": round(table, 2)}
        print(f"{name}: {bits}-bit buckets, {mismatches} of 2**32 patterns differ "
              f"({out[name]['seconds']} s); 4M values: search {searched:.1f} ms, "
              f"table {table:.1f} ms", flush=True)
    if args:
        Path(args[0]).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
