"""README.md's catalogue table is the one ``tests/catalogue.py`` generates from the registry."""

from __future__ import annotations

import catalogue
import registry


def test_readme_catalogue_is_up_to_date():
    text = catalogue.README.read_text()
    found = catalogue.readme_block(text)
    assert found is not None, (f"README.md has no catalogue markers; add {catalogue.BEGIN!r} "
                               f"and {catalogue.END!r}, then run `{catalogue.COMMAND}`")
    assert found == catalogue.block(), (
        f"README.md's catalogue table is out of date with tests/registry.py: run "
        f"`{catalogue.COMMAND}` (or `make catalogue`) and commit README.md")


def test_every_entry_has_a_row_with_measured_bytes():
    rows = catalogue.table().splitlines()[2:]
    assert len(rows) == len(registry.TRANSFORMS)
    adam = next(r for r in rows if r.startswith("| `adam` |"))
    # fp32 mu and nu: 8 bytes; 8-bit: 2 codes + 2 absmax per 256 elements.
    assert "| 8 | 2.03 |" in adam, adam
