"""The fused backend: plans, Triton code generation and launches. Only this package
imports Triton."""
