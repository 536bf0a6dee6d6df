"""The environment variables that tune the fused backend, read and checked in one place.

Each module declares its settings where their defaults are justified (``tiles.py``,
``half_tiles.py``, ...) through the readers here, which register the variable with what
its value must look like and a line of help, and turn a value that is not of that form
into a ``ValueError`` naming the variable, the value and the form expected (a setting
mistyped for a timing would otherwise time the default). ``python -m ftopt.lowering``
lists every variable with its default and the value in effect; :func:`set_here` gives
the ones set (``ftopt.explain`` prints them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LAYOUTS = ("fp32", "16-bit", "16-bit states", "8-bit")
# The words of a skip_zeros mode (ftopt.lowering.tiles.skip_mode): "select" is none of them
MODE_WORDS = ("select", "in_place", "tiles", "stores", "chunks", "split", "defer")


@dataclass(frozen=True)
class Knob:
    """A declared variable: its default (as text), the form of its values, its meaning,
    and the text it was read with (None: unset)."""

    name: str
    default: str
    form: str
    help: str
    value: str | None


KNOBS: dict[str, Knob] = {}


def read(name: str, default: str, form: str, help: str, parse: Callable[[str], T]) -> T:
    """Register ``name`` and parse its value (``default`` where unset) with ``parse``,
    which raises ``ValueError`` (its text: what is wrong, or "") for one not of ``form``."""
    KNOBS[name] = Knob(name, default, form, help, os.environ.get(name))
    text = os.environ.get(name, default)
    try:
        return parse(text)
    except ValueError as e:
        detail = f" ({e})" if str(e) else ""
        raise ValueError(f"environment variable {name}={text!r}: expected {form}{detail}; "
                         f"unset, it is {default!r}") from None


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise ValueError(f"below {minimum}")
        return value
    return parse


def _power_of_two(text: str) -> int:
    value = int(text)
    if value < 1 or value & (value - 1):
        raise ValueError(f"{value} is not a power of two")
    return value


def _tile(text: str) -> tuple[int, int]:
    block, warps = text.split("x")
    return _power_of_two(block), _power_of_two(warps)


def _layout(key: str) -> str:
    if key not in LAYOUTS:
        raise ValueError(f"{key!r} is not a layout ({', '.join(map(repr, LAYOUTS))})")
    return key


def _pairs(text: str) -> list[tuple[str, str]]:
    out = []
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r} is not LAYOUT=VALUE")
        out.append((_layout(key), value))
    return out


def integer(name: str, default: int, help: str, minimum: int = 0) -> int:
    """An integer of at least ``minimum``."""
    return read(name, str(default), f"an integer >= {minimum}", help, _at_least(minimum))


def power_of_two(name: str, default: int, help: str) -> int:
    """A power of two."""
    return read(name, str(default), "a power of two", help, _power_of_two)


def real(name: str, default: float, help: str) -> float:
    """A float."""
    return read(name, str(default), "a number", help, float)


def _switch(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError
    return text == "1"


def switch(name: str, default: bool, help: str) -> bool:
    """On ("1") or off ("0")."""
    return read(name, "1" if default else "0", '"0" or "1"', help, _switch)


def choice(name: str, default: str, choices: tuple[str, ...], help: str) -> str:
    """One of ``choices``."""
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError
        return text
    return read(name, default, "one of " + ", ".join(map(repr, choices)), help, parse)


def text(name: str, default: str, help: str) -> str:
    """Any text (a path)."""
    return read(name, default, "a path", help, str)


def tile(name: str, default: str, help: str) -> tuple[int, int]:
    """``BLOCKxWARPS``: elements and warps a program, powers of two."""
    return read(name, default, '"BLOCKxWARPS", powers of two ("512x4")', help, _tile)


def per_layout(name: str, default: str, help: str, powers: bool = False) -> dict[str, int]:
    """An integer per layout (a power of two where ``powers``): ``LAYOUT=N``,
    comma-separated ("" for none)."""
    value = _power_of_two if powers else _at_least(0)
    form = "LAYOUT=N" + (", N a power of two" if powers else "")
    return read(name, default, f'{form}, comma-separated ("fp32=56,16-bit=64")', help,
                lambda text: {k: value(v) for k, v in _pairs(text)})


def layout_set(name: str, default: str, help: str, extra: tuple[str, ...] = ()) -> frozenset:
    """Layouts (and the words ``extra``), comma-separated."""
    def parse(text: str) -> frozenset:
        words = frozenset(filter(None, text.split(",")))
        for word in words - set(extra):
            _layout(word)
        return words
    form = "layouts, comma-separated" + "".join(f", or {w!r}" for w in extra)
    return read(name, default, form, help, parse)


def layout_tiles(name: str, default: str, help: str) -> dict[str, tuple[int, int, int]]:
    """``LAYOUT=BLOCKxWARPS[/MAXNREG]``, comma-separated: (block, warps, cap; 0 none)."""
    def parse(text: str) -> dict[str, tuple[int, int, int]]:
        out = {}
        for key, spec in _pairs(text):
            tile_text, _, cap = spec.partition("/")
            out[key] = (*_tile(tile_text), _at_least(0)(cap or "0"))
        return out
    return read(name, default, 'LAYOUT=BLOCKxWARPS or LAYOUT=BLOCKxWARPS/MAXNREG, '
                'comma-separated ("16-bit states=512x2/64")', help, parse)


def skip_modes(name: str, default: str, help: str) -> dict[str, str]:
    """A skip_zeros mode per layout: ``LAYOUT=MODE``, a mode being words of
    :data:`MODE_WORDS` joined by "+"."""
    def parse(text: str) -> dict[str, str]:
        modes = dict(_pairs(text))
        for key, mode in modes.items():
            bad = [w for w in mode.split("+") if w not in MODE_WORDS]
            if bad:
                raise ValueError(f"{key}'s mode {mode!r}: {', '.join(map(repr, bad))} not "
                                 f"among {', '.join(MODE_WORDS)}")
        return modes
    return read(name, default, 'LAYOUT=MODE, comma-separated ("16-bit states=select")',
                help, parse)


def unless_set(name: str, value: T, drop: bool) -> T:
    """``value`` (read from ``name``), or its type's empty value where ``drop`` holds and
    ``name`` is unset: a table of GPU settings the interpreter's larger tiles leave out."""
    return value if not drop or name in os.environ else type(value)()


def set_here() -> dict[str, str]:
    """The declared variables that were set when read (so in effect), with their values."""
    return {name: KNOBS[name].value for name in sorted(KNOBS)
            if KNOBS[name].value is not None}


def table() -> str:
    """Every declared variable: name, default, value in effect, form and meaning."""
    lines = []
    for name in sorted(KNOBS):
        knob = KNOBS[name]
        now = f"set to {knob.value!r}" if knob.value is not None else "unset"
        lines += [f"{name}  (default {knob.default!r}; {now})",
                  f"    {knob.help}", f"    values: {knob.form}"]
    return "\n".join(lines)
