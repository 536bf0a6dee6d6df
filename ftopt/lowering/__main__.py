"""``python -m ftopt.lowering``: the environment variables that tune the fused backend,
with their defaults, the values in effect and what each sets (:mod:`ftopt.lowering.knobs`)."""

from __future__ import annotations

import sys

from ftopt.lowering import codegen, half_tiles, knobs, lanes, native, quantized, streams, tiles

# The modules that declare them (imported for their declarations)
DECLARING = (codegen, half_tiles, lanes, native, quantized, streams, tiles)


def main() -> int:
    print(knobs.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
