"""The rows of the bad-input table (run by ``test_bad_inputs.py``).

A row: a name, ``build() -> (tx, params, grads, state, kwargs)``, the error type, the
substrings its message must hold, and the entry points that do not apply with the reason.
``kwargs`` may carry ``backend`` (overrides the entry's) and, for ``tx.update`` only,
``params``. A row with ``build_error`` expects ``build()`` itself to raise.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import ftopt


@dataclass(frozen=True)
class Row:
    name: str
    build: Callable[[], tuple]
    error: type | tuple | None
    fragments: tuple[str, ...]
    skip: dict[str, str] = field(default_factory=dict)  # entry -> why it does not apply
    donate: tuple[bool, ...] = (False, True)  # for step
    build_error: type | None = None


ROWS: list[Row] = []

# Fused-only refusals need tensors the kernels can run on: a GPU's, or the CPU's under
# the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED_ONLY = "valid input for the eager backend (only the fused kernels refuse it)"
EAGER_ENTRIES = ("step-eager", "step-auto", "update-eager", "update-auto")
NO_UPDATE = ("update-eager", "update-fused", "update-auto")


def row(name: str, error, fragments, *, skip: dict | None = None,
        donate: tuple[bool, ...] = (False, True)):
    """Register the decorated builder as a row."""
    def register(build):
        ROWS.append(Row(name, build, error, tuple(fragments), skip or {}, donate))
        return build
    return register


def build_row(name: str, error, fragments):
    def register(build):
        ROWS.append(Row(name, build, None, tuple(fragments), build_error=error))
        return build
    return register


def fused_only(name: str, error, fragments, *, also: dict | None = None,
               donate: tuple[bool, ...] = (False, True)):
    return row(name, error, fragments, donate=donate,
               skip={**{e: FUSED_ONLY for e in EAGER_ENTRIES}, **(also or {})})


# ------------------------------------------------------------------------ builders


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def _params(gen):
    return {"w": torch.randn(3, 2, generator=gen), "b": torch.randn(2, generator=gen),
            "out": [torch.randn(2, generator=gen), torch.randn(1, generator=gen)]}


def _like(tree, gen):
    return ftopt.tree.map(lambda x: torch.randn(x.shape, generator=gen), tree)


def adam_case(name: str, tx=None, device: str = "cpu"):
    """tx, params, fresh random grads, tx's state after one step (not all zeros)."""
    gen = _gen(name)
    tx = tx or ftopt.adam(1e-2)
    params = ftopt.tree.map(lambda x: x.to(device), _params(gen))
    state = tx.init(params)
    grads = ftopt.tree.map(lambda x: x.to(device), _like(params, gen))
    _, state = ftopt.step(tx, params, grads, state, backend="eager")
    return tx, params, ftopt.tree.map(lambda x: x.to(device), _like(params, gen)), state


def _big(name: str):
    """One leaf of 4096 elements (8-bit states) plus a small one (32-bit states)."""
    gen = _gen(name)
    params = {"w": torch.randn(4096, generator=gen), "b": torch.randn(3, generator=gen)}
    return params, _like(params, gen), gen


def with_mu(state, **leaves):
    inner = state[0]
    return (inner._replace(mu={**inner.mu, **leaves}), *state[1:])


# --------------------------------------------------------------- 8-bit state kinds


@row("8bit_state_to_32bit_tx", ValueError,
     ["state mu at ['w']", "an 8-bit state (QuantizedSlot)", "state_bits=32"])
def _():
    params, grads, _ = _big("8bit_state_to_32bit_tx")
    state = ftopt.adam(1e-2, state_bits=8).init(params)
    return ftopt.adam(1e-2), params, grads, state, {}


@row("32bit_state_to_8bit_tx", ValueError,
     ["state mu at ['w']", "a 32-bit state given", "state_bits=8", ">= 4096 elements"])
def _():
    params, grads, _ = _big("32bit_state_to_8bit_tx")
    state = ftopt.adam(1e-2).init(params)
    return ftopt.adam(1e-2, state_bits=8), params, grads, state, {}


@row("8bit_block_size_128_to_256", ValueError,
     ["state mu at ['w']", "absmax has 32 entries, expected 16", "block_size=256"])
def _():
    params, grads, _ = _big("8bit_block_size_128_to_256")
    state = ftopt.quantize_states(ftopt.adam(1e-2), bits=8, block_size=128).init(params)
    tx = ftopt.quantize_states(ftopt.adam(1e-2), bits=8, block_size=256)
    return tx, params, grads, state, {}


@row("8bit_state_below_min_size", ValueError, ["state mu at ['w']", "< 8192 elements"])
def _():
    params, grads, _ = _big("8bit_state_below_min_size")
    state = ftopt.adam(1e-2, state_bits=8).init(params)
    return ftopt.quantize_states(ftopt.adam(1e-2), min_size=8192), params, grads, state, {}


@row("8bit_codes_int64", TypeError, ["state mu at ['w']", "codes", "torch.uint8"])
def _():
    params, grads, _ = _big("8bit_codes_int64")
    tx = ftopt.adam(1e-2, state_bits=8)
    state = tx.init(params)
    q = state[0].mu["w"]
    return tx, params, grads, with_mu(state, w=q._replace(codes=q.codes.long())), {}


@row("8bit_absmax_fp16", TypeError, ["state mu at ['w']", "absmax", "torch.float32"])
def _():
    params, grads, _ = _big("8bit_absmax_fp16")
    tx = ftopt.adam(1e-2, state_bits=8)
    state = tx.init(params)
    q = state[0].mu["w"]
    return tx, params, grads, with_mu(state, w=q._replace(absmax=q.absmax.half())), {}


@row("8bit_codes_wrong_shape", ValueError, ["state mu at ['w']", "(64, 64)", "(4096,)"])
def _():
    params, grads, _ = _big("8bit_codes_wrong_shape")
    tx = ftopt.adam(1e-2, state_bits=8)
    state = tx.init(params)
    q = state[0].mu["w"]
    return tx, params, grads, with_mu(state, w=q._replace(codes=q.codes.view(64, 64))), {}


@row("8bit_absmax_on_meta", ValueError, ["state mu at ['w']", "on meta", "cpu"])
def _():
    params, grads, _ = _big("8bit_absmax_on_meta")
    tx = ftopt.adam(1e-2, state_bits=8)
    state = tx.init(params)
    q = state[0].mu["w"]
    return tx, params, grads, with_mu(state, w=q._replace(absmax=q.absmax.to("meta"))), {}


# ------------------------------------------------------------- layouts and devices


@row("sparse_coo_grad", TypeError, ["grad at ['w']", "sparse", "g.to_dense()"])
def _():
    tx, params, grads, state = adam_case("sparse_coo_grad")
    return tx, params, {**grads, "w": grads["w"].to_sparse()}, state, {}


@row("sparse_csr_grad_skip_zeros", TypeError, ["grad at ['w']", "sparse", "g.to_dense()"])
def _():
    tx, params, grads, state = adam_case("sparse_csr_grad_skip_zeros",
                                          ftopt.adam(1e-2, skip_zeros=True))
    return tx, params, {**grads, "w": grads["w"].to_sparse_csr()}, state, {}


@row("sparse_coo_param", TypeError, ["params at ['w']", "sparse"])
def _():
    tx, params, grads, state = adam_case("sparse_coo_param")
    return tx, {**params, "w": params["w"].to_sparse()}, grads, state, {}


@row("sparse_state", TypeError, ["state mu at ['w']", "sparse"])
def _():
    tx, params, grads, state = adam_case("sparse_state")
    return tx, params, grads, with_mu(state, w=state[0].mu["w"].to_sparse()), {}


@row("grad_on_meta", ValueError, ["grad at ['w']: on meta", "param's device cpu"])
def _():
    tx, params, grads, state = adam_case("grad_on_meta")
    return tx, params, {**grads, "w": grads["w"].to("meta")}, state, {}


@row("state_on_meta", ValueError, ["state mu at ['w']: on meta", "param's device cpu"])
def _():
    tx, params, grads, state = adam_case("state_on_meta")
    return tx, params, grads, with_mu(state, w=state[0].mu["w"].to("meta")), {}


@row("param_on_meta", ValueError, ["grad at ['w']: on cpu", "param's device meta"])
def _():
    tx, params, grads, state = adam_case("param_on_meta")
    return tx, {**params, "w": params["w"].to("meta")}, grads, state, {}


@fused_only("noncontiguous_grad", RuntimeError, ["grad at ['w'] is not contiguous"])
def _():
    tx, params, grads, state = adam_case("noncontiguous_grad", device=DEVICE)
    return tx, params, {**grads, "w": grads["w"].t().contiguous().t()}, state, {}


@fused_only("noncontiguous_state", RuntimeError, ["state mu at ['w'] is not contiguous"])
def _():
    tx, params, grads, state = adam_case("noncontiguous_state", device=DEVICE)
    return tx, params, grads, with_mu(state, w=state[0].mu["w"].t().contiguous().t()), {}


@fused_only("float64_params", RuntimeError,
            ["param at ['w']: dtype torch.float64 is not fp32/fp16/bf16"])
def _():
    tx, params, grads, state = adam_case("float64_params", device=DEVICE)
    return tx, {**params, "w": params["w"].double()}, grads, state, {}


@fused_only("float64_grad", RuntimeError,
            ["grad at ['b']: dtype torch.float64 is not fp32/fp16/bf16"])
def _():
    tx, params, grads, state = adam_case("float64_grad", device=DEVICE)
    return tx, params, {**grads, "b": grads["b"].double()}, state, {}


@fused_only("fp64_state", RuntimeError,
            ["state mu at ['w']: dtype torch.float64 is not fp32, bf16 or fp16"])
def _():
    tx, params, grads, state = adam_case("fp64_state", device=DEVICE)
    return tx, params, grads, with_mu(state, w=state[0].mu["w"].double()), {}


@fused_only("param_requires_grad", RuntimeError, ["param requires grad at ['w']"],
            donate=(False,))  # a donated step is never differentiable: it fuses
def _():
    tx, params, grads, state = adam_case("param_requires_grad", device=DEVICE)
    return tx, {**params, "w": params["w"].clone().requires_grad_()}, grads, state, {}


@fused_only("grad_requires_grad", RuntimeError, ["gradient requires grad at ['w']"],
            also={"step-fused": "a step is not differentiable in its gradients: it fuses"})
def _():
    tx, params, grads, state = adam_case("grad_requires_grad", device=DEVICE)
    return tx, params, {**grads, "w": grads["w"].clone().requires_grad_()}, state, {}


# ---------------------------------------------------------------- tree structure


@row("grads_missing_key", ValueError, ["['w']", "missing"])
def _():
    tx, params, grads, state = adam_case("grads_missing_key")
    del grads["w"]
    return tx, params, grads, state, {}


@row("grads_extra_key", ValueError, ["['v']", "unexpected"])
def _():
    tx, params, grads, state = adam_case("grads_extra_key")
    return tx, params, {**grads, "v": torch.randn(2)}, state, {}


@row("grads_list_too_long", ValueError, ["['out']", "length 2", "length 3"])
def _():
    tx, params, grads, state = adam_case("grads_list_too_long")
    return tx, params, {**grads, "out": [*grads["out"], torch.randn(1)]}, state, {}


@row("grads_wrong_container", ValueError, ["['out']", "list", "tuple"])
def _():
    tx, params, grads, state = adam_case("grads_wrong_container")
    return tx, params, {**grads, "out": tuple(grads["out"])}, state, {}


@row("grad_where_params_hold_none", (ValueError, TypeError), ["['w']", "NoneType"])
def _():
    tx, params, grads, _ = adam_case("grad_where_params_hold_none")
    params = {**params, "w": None}
    return tx, params, grads, tx.init(params), {}


@row("state_for_a_smaller_model", ValueError, ["['w']", "missing"])
def _():
    tx, params, grads, _ = adam_case("state_for_a_smaller_model")
    return tx, params, grads, tx.init({k: v for k, v in params.items() if k != "w"}), {}


@row("state_extra_key", ValueError, ["['z']", "unexpected"])
def _():
    tx, params, grads, _ = adam_case("state_extra_key")
    return tx, params, grads, tx.init({**params, "z": torch.randn(2)}), {}


@row("state_slot_none", TypeError, ["state mu at ['w']", "expected a tensor", "NoneType"])
def _():
    tx, params, grads, state = adam_case("state_slot_none")
    return tx, params, grads, with_mu(state, w=None), {}


@row("state_wrong_type", ValueError, ["ScaleByAdamState", "dict"])
def _():
    tx, params, grads, state = adam_case("state_wrong_type")
    return tx, params, grads, (state[0]._asdict(), state[1]), {}


@row("state_of_another_optimizer", ValueError, ["ScaleByAdamState", "TraceState"])
def _():
    tx, params, grads, _ = adam_case("state_of_another_optimizer")
    return tx, params, grads, ftopt.sgd(0.1, momentum=0.9).init(params), {}


@row("chain_state_too_short", ValueError, ["2 transforms", "length 1"])
def _():
    tx, params, grads, state = adam_case("chain_state_too_short")
    return tx, params, grads, state[:1], {}


@row("state_none", ValueError, ["2 states", "NoneType"])
def _():
    tx, params, grads, _ = adam_case("state_none")
    return tx, params, grads, None, {}


@row("adamw_mask_missing_key", ValueError, ["mask", "['w']", "missing"])
def _():
    _, params, grads, state = adam_case("adamw_mask_missing_key", ftopt.adamw(1e-2, mask={
        "w": True, "b": False, "out": [True, True]}))
    bad = ftopt.adamw(1e-2, mask={"b": False, "out": [True, True]})
    return bad, params, grads, state, {}


NOT_FUSIBLE = {"step-fused": "backend='fused' refuses the transform (no elementwise "
                             "rule) before it reads the inputs"}


@row("masked_mask_wrong_structure", ValueError, ["mask", "['out']", "length 2"],
     skip=NOT_FUSIBLE)
def _():
    tx, params, grads, state = adam_case("masked_mask_wrong_structure", ftopt.masked(
        ftopt.adam(1e-2), {"w": True, "b": False, "out": [True, False]}))
    bad = ftopt.masked(ftopt.adam(1e-2), {"w": True, "b": False, "out": [True]})
    return bad, params, grads, state, {}


@row("partition_label_without_transform", ValueError, ["partition", "'c'", "no transform"],
     skip=NOT_FUSIBLE)
def _():
    labels = {"w": "a", "b": "b", "out": ["a", "b"]}
    txs = {"a": ftopt.adam(1e-2), "b": ftopt.sgd(0.1)}
    _, params, grads, state = adam_case("partition_label_without_transform",
                                         ftopt.partition(txs, labels))
    bad = ftopt.partition(txs, {**labels, "out": ["a", "c"]})
    return bad, params, grads, state, {}
