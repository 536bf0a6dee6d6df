"""``python -m ftopt demo [options]``: the demo (see :mod:`ftopt.demo`)."""

from __future__ import annotations

import sys

from ftopt import demo

COMMANDS = {"demo": demo.main}


def main(argv: list[str] | None = None) -> int:
    """Run the command named by the first argument."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m ftopt {{{','.join(COMMANDS)}}} [options]\n"
              "  demo  a short training run on built-in data (--help for its options)",
              file=sys.stderr)
        return 2
    COMMANDS[argv[0]](argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
