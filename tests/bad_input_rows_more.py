"""More rows of the bad-input table: shapes and dtypes, step counts, call arguments, and
bad arguments to the constructors (see ``bad_input_rows.py`` for the row format)."""

from __future__ import annotations

import math

import torch
from bad_input_rows import NO_UPDATE, adam_case, build_row, row, with_mu

import ftopt

# ------------------------------------------------------------- shapes and dtypes


@row("grad_wrong_shape", ValueError, ["['w']", "(2, 3)", "(3, 2)"])
def _():
    tx, params, grads, state = adam_case("grad_wrong_shape")
    return tx, params, {**grads, "w": grads["w"].reshape(2, 3)}, state, {}


@row("state_wrong_shape", ValueError, ["state mu at ['w']", "(2, 3)", "(3, 2)"])
def _():
    tx, params, grads, state = adam_case("state_wrong_shape")
    return tx, params, grads, with_mu(state, w=state[0].mu["w"].reshape(2, 3)), {}


@row("zero_dim_leaf_wrong_shape", ValueError, ["['s']", "(1,)", "()"])
def _():
    tx, params, grads, _ = adam_case("zero_dim_leaf_wrong_shape")
    params = {**params, "s": torch.randn(())}
    return tx, params, {**grads, "s": torch.randn(1)}, tx.init(params), {}


@row("empty_leaf_wrong_shape", ValueError, ["['e']", "(0, 3)", "(0,)"])
def _():
    tx, params, grads, _ = adam_case("empty_leaf_wrong_shape")
    params = {**params, "e": torch.randn(0)}
    return tx, params, {**grads, "e": torch.randn(0, 3)}, tx.init(params), {}


@row("int_params", TypeError, ["params at ['w']", "floating-point", "torch.int64"])
def _():
    tx, params, grads, state = adam_case("int_params")
    return tx, {**params, "w": torch.randint(-5, 5, (3, 2))}, grads, state, {}


@row("complex_params", TypeError, ["params at ['b']", "floating-point", "torch.complex64"])
def _():
    tx, params, grads, state = adam_case("complex_params")
    return tx, {**params, "b": torch.randn(2, dtype=torch.complex64)}, grads, state, {}


@row("int_grads", TypeError, ["update at ['w']", "floating-point", "torch.int32"])
def _():
    tx, params, grads, state = adam_case("int_grads")
    return tx, params, {**grads, "w": torch.randint(-5, 5, (3, 2), dtype=torch.int32)}, \
        state, {}


@row("bool_grads", TypeError, ["update at ['b']", "floating-point", "torch.bool"])
def _():
    tx, params, grads, state = adam_case("bool_grads")
    return tx, params, {**grads, "b": torch.tensor([True, False])}, state, {}


@row("complex_grads", TypeError, ["update at ['out'][1]", "torch.complex64"])
def _():
    tx, params, grads, state = adam_case("complex_grads")
    out = [grads["out"][0], torch.randn(1, dtype=torch.complex64)]
    return tx, params, {**grads, "out": out}, state, {}


@row("str_grad_leaf", TypeError, ["update at ['b']", "tensor", "str"])
def _():
    tx, params, grads, state = adam_case("str_grad_leaf")
    return tx, params, {**grads, "b": "0.1"}, state, {}


@row("int_state_leaf", TypeError, ["state nu at ['w']", "floating-point", "torch.int32"])
def _():
    tx, params, grads, state = adam_case("int_state_leaf")
    inner = state[0]
    nu = {**inner.nu, "w": inner.nu["w"].to(torch.int32)}
    return tx, params, grads, (inner._replace(nu=nu), state[1]), {}


# ------------------------------------------------------------------ step counts


def _count_row(name: str, count_fn, fragments):
    @row(name, ValueError, ["scale_by_adam", "state.count", *fragments])
    def _():
        tx, params, grads, state = adam_case(name)
        return tx, params, grads, (state[0]._replace(count=count_fn()), state[1]), {}


_count_row("count_float_tensor", lambda: torch.tensor(1.0), ["0-d integer tensor",
                                                             "torch.float32"])
_count_row("count_python_int", lambda: 1, ["0-d integer tensor", "got int"])
_count_row("count_1d", lambda: torch.ones(2, dtype=torch.int32), ["0-d integer", "(2,)"])
_count_row("count_bool", lambda: torch.tensor(True), ["0-d integer tensor", "torch.bool"])
_count_row("count_none", lambda: None, ["0-d integer tensor", "NoneType"])
_count_row("count_on_meta", lambda: torch.zeros((), dtype=torch.int32, device="meta"),
           ["meta"])


# ------------------------------------------------------------- arguments of calls


@row("backend_bogus", ValueError, ["backend", "'bogus'", "'fused'"])
def _():
    return (*adam_case("backend_bogus"), {"backend": "bogus"})


@row("update_needs_params", ValueError, ["add_decayed_weights", "needs params"],
     skip={e: "step always has params" for e in ("step-eager", "step-fused", "step-auto")})
def _():
    tx, params, grads, state = adam_case("update_needs_params", ftopt.adamw(1e-2))
    return tx, params, grads, state, {"params": None}


@row("step_tx_is_a_function", TypeError, ["step: argument tx", "function"],
     skip={e: "a function has no update method to call" for e in NO_UPDATE})
def _():
    _, params, grads, state = adam_case("step_tx_is_a_function")
    return (lambda u, s, p=None: (u, s)), params, grads, state, {}


@row("step_tx_is_none", TypeError, ["step: argument tx", "NoneType"],
     skip={e: "None has no update method to call" for e in NO_UPDATE})
def _():
    _, params, grads, state = adam_case("step_tx_is_none")
    return None, params, grads, state, {}


# --------------------------------------------- construction (build() itself raises)


def _fn(u, p):
    return u


@build_row("chain_of_a_function", TypeError, ["chain element 0", "function", "'_fn'"])
def _():
    return ftopt.chain(_fn)


@build_row("chain_with_none", TypeError, ["chain element 1", "NoneType"])
def _():
    return ftopt.chain(ftopt.adam(1e-2), None)


@build_row("chain_of_an_uncalled_alias", TypeError, ["chain element 0", "'adam'",
                                                     "ftopt.adam(1e-3)"])
def _():
    return ftopt.chain(ftopt.adam)


@build_row("named_chain_of_a_function", TypeError, ["named_chain element 0 ('a')", "function"])
def _():
    return ftopt.named_chain(("a", _fn))


@build_row("named_chain_not_pairs", TypeError, ["named_chain element 0", "(name, transform)",
                                                "GradientTransformation"])
def _():
    return ftopt.named_chain(ftopt.adam(1e-2))


@build_row("masked_of_a_function", TypeError, ["masked: argument inner", "function"])
def _():
    return ftopt.masked(_fn, {"w": True})


@build_row("partition_of_a_function", TypeError, ["partition: transforms['a']", "function"])
def _():
    return ftopt.partition({"a": _fn}, {"w": "a"})


@build_row("partition_of_a_list", TypeError, ["partition: argument transforms", "list"])
def _():
    return ftopt.partition([ftopt.adam(1e-2)], {"w": 0})


@build_row("skip_zeros_of_a_function", TypeError, ["skip_zeros: argument inner", "function"])
def _():
    return ftopt.skip_zeros(_fn)


@build_row("quantize_states_of_none", TypeError, ["quantize_states: argument tx", "NoneType"])
def _():
    return ftopt.quantize_states(None)


@build_row("explain_of_a_function", TypeError, ["explain: argument tx", "function"])
def _():
    return ftopt.explain(_fn, {"w": torch.randn(2)})


@build_row("explain_backend_bogus", ValueError, ["backend", "'bogus'"])
def _():
    return ftopt.explain(ftopt.adam(1e-2), {"w": torch.randn(2)}, backend="bogus")


@build_row("learning_rate_str", TypeError, ["learning_rate", "str"])
def _():
    return ftopt.adam("0.1")


@build_row("learning_rate_nan", ValueError, ["learning_rate", "finite"])
def _():
    return ftopt.adam(math.nan)


@build_row("b1_list", TypeError, ["b1", "list"])
def _():
    return ftopt.adam(1e-2, b1=[0.9])
