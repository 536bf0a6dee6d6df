"""A kernel shape to time before generating it: the select kernels of Adam over bf16
params and states with their skip_zeros selects on the stored 16-bit words (the loaded
raw words) instead of the widened fp32 values, in the full-block body (the NaN checks on
the raw words too, as the plain kernel's). Static SASS (sm_90): all four 128-bit loads
up front, where the generated kernel issues two (``benchmarks/RESULTS.md``).

    python3 benchmarks/raw_select_edit.py OUT SRC...

writes ``OUT/<name>`` for each generated source ``SRC`` (``ftopt_<key>.py``) it can
edit and says which; run the step with ``FTOPT_KERNEL_SOURCES=OUT`` to time them. On a
GPU, take the sources its steps generate (``TMPDIR=DIR``: ``DIR/ftopt_kernels_*/``).
"""
import os
import re
import sys


def edit(src: str) -> str | None:
    head, sep, tail = src.partition("    else:\n        in_range = offs < n")
    if not sep or "zero = g == 0.0" not in head or "st0_mu_old_raw" not in head:
        return None
    for slot in ("mu", "nu"):
        m = re.search(rf"\n\s+(\w+) = tl\.where\(zero, st0_{slot}_old, (\w+)\)", head)
        if not m:
            return None
        head = head.replace(m.group(0), "")
        head = re.sub(rf"\b{m.group(1)}\b", m.group(2), head)
        nan = (f"tl.where(st0_{slot}_old != st0_{slot}_old, st0_{slot}_old.to(tl.uint32, "
               f"bitcast=True) >> 16, 32704)")
        if nan not in head:
            return None
        head = head.replace(nan, f"tl.where((st0_{slot}_old_raw & 32767) > 32640, "
                                 f"st0_{slot}_old_raw.to(tl.uint32), 32704)")
        store = f"tl.store(st0_{slot}_out + offs, b_st0_{slot}_u.to(tl.uint16))"
        if store not in head:
            return None
        head = head.replace(store, f"tl.store(st0_{slot}_out + offs, tl.where(zero, "
                                   f"st0_{slot}_old_raw, b_st0_{slot}_u.to(tl.uint16)))")
    m = re.search(r"\n(\s+)(\w+) = tl\.where\(zero, neg_zero, (\w+)\)\n\s+(\w+) = p \+ \2\n", head)
    if not m:
        return None
    head = head.replace(m.group(0), f"\n{m.group(1)}{m.group(4)} = p + {m.group(3)}\n")
    load = ("p = (tl.load(p_ptr + offs).to(tl.uint16, bitcast=True).to(tl.uint32) << 16)"
            ".to(tl.float32, bitcast=True)")
    if load not in head:
        return None
    head = head.replace(load, "p_raw = tl.load(p_ptr + offs)\n        p = (p_raw.to(tl.uint16, "
                              "bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)")
    v = m.group(4)
    store = (f"tl.store(p_out + offs, (tl.where(({v} != {v}) & (p != p), (p.to(tl.uint32, "
             f"bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), "
             f"({v}).to(tl.bfloat16))).to(tl.bfloat16))")
    if store not in head:
        return None
    head = head.replace(store, f"tl.store(p_out + offs, tl.where(zero | (({v} != {v}) & "
                               f"(p != p)), p_raw, ({v}).to(tl.bfloat16)))")
    return head + sep + tail


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    done = 0
    for path in sys.argv[2:]:
        new = edit(open(path).read())
        if new is not None:
            with open(os.path.join(out, os.path.basename(path)), "w") as f:
                f.write(new)
            done += 1
            print("edited", path)
    print(f"{done} kernels edited")
