"""The fused backend: plans, Triton code generation and launches. Only this package
imports Triton.

Installed in :mod:`ftopt.dispatch` when ``ftopt`` is imported (``ftopt/__init__.py``):
``fused`` is :mod:`ftopt.lowering.entry` (imported on first use), ``compile`` is
:mod:`ftopt.lowering.op` (``ftopt.step`` under ``torch.compile``).
"""
