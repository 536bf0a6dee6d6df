"""Runs one fused step of a planned chain: scalars, tables, reductions, main kernels."""

from __future__ import annotations

import torch

from ftopt import tree as tree_lib
from ftopt.lowering import launch
from ftopt.lowering.plan import ChainPlan, host_step, remember
from ftopt.rules import step_scalars


def _uses_tensors(plan: ChainPlan) -> bool:
    return any(isinstance(v, torch.Tensor) for s in plan.stages for v in s.rule.hparams.values())


def _advance_counts(plan: ChainPlan, stage_states, donate: bool, tensor_mode: bool):
    """Per stage: (count, t) for its scalars and its new count tensor."""
    steps, new_counts = [], []
    for stage, st in zip(plan.stages, stage_states):
        if not stage.rule.counted:
            steps.append((None, None))
            new_counts.append(None)
            continue
        count, t = host_step(st.count, tensor_mode)
        new = st.count.add_(1) if donate else st.count + 1
        if not tensor_mode:
            remember(new, t)
        steps.append((count, t))
        new_counts.append(new)
    return steps, new_counts


def _scalar_buffer(plan: ChainPlan, steps, device) -> torch.Tensor:
    per_stage = [step_scalars(stage.rule, *step) for stage, step in zip(plan.stages, steps)]
    values = [per_stage[i][name] for i, name in plan.traced.graph.scalars]
    if not values:
        return torch.zeros(1, dtype=torch.float32, device=device)
    if any(isinstance(v, torch.Tensor) for v in values):
        return torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(())
                            for v in values])
    host = torch.tensor(values, dtype=torch.float64).to(torch.float32)
    if device.type != "cpu":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _leaf_values(plan: ChainPlan, params, n_leaves: int, paths, group, device):
    specs = plan.traced.graph.leaf_values
    if not specs:
        return torch.zeros(1, dtype=torch.float32, device=device)
    masks = {i: plan.stages[i]._leaf_mask(params, n_leaves, paths) for i, _ in specs}
    rows = [[1.0 if masks[i] is None or masks[i][leaf] else 0.0 for i, _ in specs]
            for leaf in group.leaves]
    return torch.tensor(rows, dtype=torch.float32).reshape(-1).to(device)


def execute(plan: ChainPlan, spec, paths, p_flat, g_flat, stage_states, slot_flat, active, params,
            donate: bool):
    traced = plan.traced
    device = p_flat[active[0]].device if active else torch.device("cpu")
    steps, new_counts = _advance_counts(plan, stage_states, donate, _uses_tensors(plan))
    p_out = list(p_flat)
    slot_out = [{name: list(leaves) for name, leaves in slots.items()} for slots in slot_flat]
    if not donate:
        for i in active:
            p_out[i] = torch.empty_like(p_flat[i])
            for slots in slot_out:
                for leaves in slots.values():
                    leaves[i] = torch.empty_like(leaves[i])
    if active:
        _launch(plan, traced, p_flat, g_flat, slot_flat, p_out, slot_out, active, params,
                paths, device, steps)
    new_params = tree_lib.unflatten(spec, p_out)
    new_states = []
    for stage, st, slots, count in zip(plan.stages, stage_states, slot_out, new_counts):
        values = {name: tree_lib.unflatten(spec, leaves) for name, leaves in slots.items()}
        if stage.rule.counted:
            values["count"] = count
        new_states.append(type(st)(**values))
    return new_params, new_states


def _addresses(traced, group, p_flat, g_flat, slot_flat, p_out, slot_out) -> dict:
    idx = group.leaves
    table = {"g": [g_flat[i].data_ptr() for i in idx],
             "p": [p_flat[i].data_ptr() for i in idx],
             "p_out": [p_out[i].data_ptr() for i in idx]}
    for stage_i, name in traced.slot_roles:
        table[f"st{stage_i}_{name}_in"] = [slot_flat[stage_i][name][i].data_ptr() for i in idx]
        table[f"st{stage_i}_{name}_out"] = [slot_out[stage_i][name][i].data_ptr() for i in idx]
    return table


def _launch(plan, traced, p_flat, g_flat, slot_flat, p_out, slot_out, active, params, paths,
            device, steps):
    groups = launch.make_groups(p_flat, g_flat, active)
    tables = [
        launch.GroupTables(group, [p_flat[i].numel() for i in group.leaves],
                           _addresses(traced, group, p_flat, g_flat, slot_flat, p_out,
                                      slot_out))
        for group in groups
    ]
    scalars = _scalar_buffer(plan, steps, device)
    leaf_values = [_leaf_values(plan, params, len(p_flat), paths, group, device)
                   for group in groups]
    index = {id(t): k for k, t in enumerate(tables)}

    def args_of(group, tab, buf, global_buf, roles):
        views = tab.views
        return [views["block_leaf"], views["block_start"], views["numel"],
                *[views[r] for r in roles], scalars, leaf_values[index[id(tab)]], buf,
                global_buf]

    leaf_bufs, global_buf = launch.run_reductions(traced, groups, tables, args_of, device)
    launch.run_main(traced, groups, tables, args_of, leaf_bufs, global_buf)
