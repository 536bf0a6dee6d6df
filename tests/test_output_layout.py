"""Outputs of non-donated fused steps and updates: one buffer per (group, role), cut into
per-leaf views that the kernels write through their byte offsets."""

from __future__ import annotations

import pytest
import torch

from ftopt.lowering.functional import output_layout

SHAPES = [(7,), (3, 8), (0,), (), (5, 3), (2, 4, 4), (1,), (4, 8), (2, 0, 3), (3, 1),
          (6, 4, 4), (9,), (1, 1), (2, 3, 5, 7), (16, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_views_have_the_shapes_offsets_and_no_overlap(dtype):
    shapes = [torch.Size(s) for s in SHAPES]
    layout = output_layout(shapes, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    buffer = torch.full((layout.total,), float("nan"), dtype=dtype)
    views = layout.views(buffer)
    assert len(views) == len(shapes)
    base = buffer.data_ptr()
    owner = torch.full((layout.total,), -1)
    for k, (view, shape) in enumerate(zip(views, shapes)):
        assert view.shape == shape and view.dtype == dtype and view.is_contiguous(), k
        if shape.numel() == 0:
            continue
        offset = view.data_ptr() - base
        assert offset == layout.byte_offsets[k] and offset % 16 == 0, k
        first = offset // size
        span = owner[first:first + shape.numel()]
        assert span.numel() == shape.numel() and (span == -1).all(), k  # in bounds, alone
        span.fill_(k)
        view.fill_(k)  # the leaf's elements are the view's, in its order
        assert (buffer[first:first + shape.numel()] == k).all()
    # One run per trailing shape cuts the common cases with one call each: 1-d leaves,
    # (k, 8) and (k, 4, 4) leaves (rows of whole 16-byte units); the rest one by one.
    assert [run[2] for run in layout.runs] == [(-1,), (-1, 8), (-1, 4, 4)]
    assert [single[0] for single in layout.singles] == [shapes[k] for k in (3, 4, 9, 12, 13)]
