"""The roles a generated kernel reaches through address tables (``g``, ``p``, ``x``, each
slot's ``st{i}_{name}_in``/``_out``, 8-bit absmax), and the Triton dtype of each."""

from __future__ import annotations

import torch

__all__ = ["input_roles", "output_roles", "role_dtypes", "slot_signs", "element_slots",
           "wide_slots", "elided_slots", "kept_stores"]

_TL_DTYPES = {torch.float32: "tl.float32", torch.float16: "tl.float16",
              torch.bfloat16: "tl.bfloat16"}
# 16-bit slots as stored: bf16 as its bits, converted by hand (the interpreter's fp32 ->
# bf16 cast truncates; the bit arithmetic rounds to nearest even on every backend).
_STORED = {torch.float16: "tl.float16", torch.bfloat16: "tl.uint16"}


def role_dtypes(traced, variant) -> dict:
    p_name, g_name = _TL_DTYPES[variant.p_dtype], _TL_DTYPES[variant.g_dtype]
    dtypes = {"g": g_name, "p": p_name, "p_out": p_name, "u_out": "tl.float32",
              "x": "tl.float32"}
    state = "tl.uint8" if variant.quant_block else "tl.float32"
    half = dict(variant.slot_dtypes)
    wide = wide_slots(traced)
    for i, name in traced.slot_roles:
        role = f"st{i}_{name}"
        for io in ("in", "out"):
            dtypes[f"{role}_{io}"] = (
                "tl.float32" if role in traced.leaf_slots
                else _STORED.get(half.get(role), "tl.float32" if role in wide else state))
            dtypes[f"{role}_amax_{io}"] = "tl.float32"
    return dtypes


def input_roles(traced, quantized: bool = False) -> list[str]:
    roles = ["g", "p"] + (["x"] if traced.seeded else [])
    roles += [f"st{i}_{n}_in" for i, n in traced.slot_roles]
    if quantized:
        roles += [f"st{i}_{n}_amax_in" for i, n in element_slots(traced)]
    return roles


def output_roles(traced, quantized: bool = False) -> list[str]:
    elided = elided_slots(traced, quantized)
    roles = [f"{traced.output}_out"] + [f"st{i}_{n}_out" for i, n in traced.slot_roles
                                         if f"st{i}_{n}" not in elided]
    if quantized:
        roles += [f"st{i}_{n}_amax_out" for i, n in element_slots(traced)]
    return roles


def element_slots(traced) -> list[tuple[int, str]]:
    """The slots 8-bit storage applies to: not the per-leaf ones, nor the copies of the
    params (:func:`wide_slots`)."""
    wide = wide_slots(traced)
    return [(i, n) for i, n in traced.slot_roles
            if f"st{i}_{n}" not in traced.leaf_slots and f"st{i}_{n}" not in wide]


def wide_slots(traced) -> set[str]:
    """``st{i}_{name}`` of the slots that start as a copy of the params
    (:attr:`ftopt.rules.Slot.from_params`): never 8-bit, so an 8-bit kernel loads and
    stores them as floats (fp32, or the 16-bit dtype they were given)."""
    return {f"st{k}_{slot.name}" for k, pos in enumerate(traced.positions)
            for slot in traced.stages[pos[0]].rule.slots if slot.from_params}


def slot_signs(traced) -> dict[str, bool]:
    """``st{i}_{name}`` -> whether the slot uses the signed 8-bit map (the slots of
    :func:`element_slots`)."""
    return {f"st{k}_{slot.name}": slot.signed for k, pos in enumerate(traced.positions)
            for slot in traced.stages[pos[0]].rule.slots
            if not slot.per_leaf and not slot.from_params}


def elided_slots(traced, quantized: bool = False) -> set[str]:
    """``st{i}_{name}`` of the slots a donated step does not store: the body returns the
    slot as it was (its new value is the very node of its load), and the kernel writes
    over the input, which already holds those bytes. Not an 8-bit slot (re-encoding its
    old value under a new absmax may change its codes, as the eager step does), nor a
    per-leaf one (a donated step stores those to scratch, copied back). A step that is
    not donated stores every slot: its new state must not share the caller's tensors."""
    if not traced.donated:
        return set()
    stored = {role[: -len("_out")]: node for role, node in traced.stores}
    coded = {f"st{i}_{n}" for i, n in element_slots(traced)} if quantized else set()
    return {role for role, node in stored.items()
            if node == f"{role}_old" and role not in traced.leaf_slots and role not in coded}


def kept_stores(traced, quantized: bool = False) -> list[tuple[str, str]]:
    """``traced.stores`` but those of :func:`elided_slots`."""
    elided = elided_slots(traced, quantized)
    return [(role, node) for role, node in traced.stores
            if role[: -len("_out")] not in elided]
