"""ftopt on DTensor params (FSDP2, HSDP, tensor parallel), DDP and DCP, in two processes.

The processes are spawned once for the module (gloo on the CPU); each runs every check of
``tests/distributed_checks.py`` and rank 0 reports the measurements judged here. The
references are single-process runs of the same model on the same full batch.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist

import ftopt

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available in this torch build")

TOL = 5e-7  # 32-bit states: the norms sum shard by shard, in another order


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import distributed_checks
    import torch.multiprocessing as mp

    directory = str(tmp_path_factory.mktemp("distributed"))
    try:
        mp.spawn(distributed_checks.run, args=(2, directory, _free_port()), nprocs=2)
    except Exception as err:  # a rank died: say where each rank was
        logs = []
        for rank in range(2):
            path = os.path.join(directory, f"progress_{rank}.log")
            lines = open(path).read().splitlines()[-3:] if os.path.exists(path) else []
            logs.append(f"rank {rank}: {lines}")
        raise RuntimeError(f"{err}; last progress: {'; '.join(logs)}") from err
    with open(os.path.join(directory, "results.json")) as f:
        found = json.load(f)
    found["_directory"] = directory
    return found


def _check(results, name):
    got = results[name]
    assert "raised" not in got, got.get("raised")
    return got


@pytest.mark.parametrize("chain", ["adamw", "adamw_clip", "lamb", "lion",
                                   "adamw_skip_zeros", "adamw_8bit"])
def test_fsdp2_matches_one_process(results, chain):
    got = _check(results, "fsdp_chains")[chain]
    assert got["moved"] > 1e-3  # the params did train
    assert got["max_diff"] <= TOL, got
    assert got["state_is_dtensor"]
    if chain == "adamw_skip_zeros":
        assert got["zero_rows_kept"]  # rows no batch used: bit-identical
    if chain == "adamw_8bit":
        assert got["is_8bit"] and got["small_leaf_32bit"]
        assert got["codes_equal"] and got["absmax_equal"]
        assert got["max_diff"] == 0.0


def test_update_and_non_donated_step(results):
    got = _check(results, "update_and_non_donated")
    assert got["eager_diff"] <= TOL and got["update_diff"] <= TOL, got
    assert got["eager_inputs_untouched"] and got["update_inputs_untouched"]
    assert got["update_is_dtensor"]


def test_fused_on_shards(results):
    got = _check(results, "fused")
    if "skipped" in got:
        pytest.skip(got["skipped"])
    assert got["adamw_clip"] <= TOL and got["lamb"] <= TOL, got
    assert got["adamw_8bit"] == 0.0, got


def test_novograd_on_split_leaves(results):
    """NovoGrad's per-leaf norm on uneven Shard(0) leaves is the whole leaf's (summed over
    the mesh): the params equal one process's, eager and fused (skip_zeros, a leaf zero
    on one rank only, an all-zero leaf)."""
    got = _check(results, "novograd_split")
    assert set(got) >= {"eager"}, got
    assert all(diff <= TOL for diff in got.values()), got


def test_hsdp_tensor_parallel_and_refusals(results):
    got = _check(results, "hsdp_and_tensor_parallel")
    assert got["hsdp_placements"] == "(Replicate(), Shard(dim=0))"
    assert got["hsdp_diff"] <= TOL and got["tp_shard1_diff"] <= TOL, got
    assert got["mixed_elementwise_diff"] == 0.0
    # Norms over a mix of layouts of one mesh: right (a replicated leaf counts once).
    assert got["hsdp_mixed_diff"] <= TOL, got
    assert got["tp_mixed_auto_diff"] <= TOL and got.get("tp_mixed_fused_diff", 0) <= TOL, got
    error = got["mixed_error"]
    assert error is not None and "Shard(dim=1)" in error and "a plain tensor" in error, error
    assert got["mixed_untouched"]
    assert "Partial(sum)" in got["partial_error"] and "grads at ['w']" in got["partial_error"]
    assert "inside a block" in got["misaligned_error"]


def test_dtensor_pointer_guard(results):
    got = _check(results, "pointer_guard")
    assert got["data_ptr"] == 0  # what a kernel would read without the guard
    assert "reached the fused kernels" in got["error"]
    if "dtensor_grad_diff" in got:  # (fused kernels run here)
        assert got["dtensor_grad_diff"] <= TOL, got


def test_cached_dtensor_step(results):
    """The donated DTensor step over the same trees skips unwrap and rewrap; a swapped
    storage or state leaf sends it to the full path; the results equal one process."""
    got = _check(results, "cached_step")
    if "skipped" in got:
        pytest.skip(got["skipped"])
    assert got["full_calls"] == 1, got  # the first of 4 steps only
    assert got["same_objects"] and got["same_params"], got
    assert got["diff"] <= TOL, got
    # Steps 1, 3 (param storage swapped) and 4 (state leaf replaced) take the full path.
    assert got["swap_full_calls"] == 3, got
    assert got["swap_diff"] <= TOL and got["swap_state_diff"] <= TOL, got


def test_cached_non_donated_step_and_update(results):
    """Non-donated steps and tx.update over the same DTensor trees skip the unwrap after
    the first call and give new DTensors (placements kept, 8-bit absmax too), equal to one
    process, the inputs untouched; another layout takes the full path once."""
    got = _check(results, "call_cache")
    kinds = [k[:-len("_full_calls")] for k in got if k.endswith("_full_calls")
             and not k.startswith("relayout")]
    assert len(kinds) >= 2, got
    for key in kinds:
        assert got[f"{key}_full_calls"] == 1, (key, got)  # the first of 3 calls only
        assert got[f"{key}_diff"] <= TOL and got[f"{key}_state_diff"] <= TOL, (key, got)
        assert got[f"{key}_dtensors"] and got[f"{key}_8bit"], (key, got)
        assert got[f"{key}_untouched"], (key, got)
    # Shard(0), then Replicate twice: the second call's specs differ from the cached
    # ones (the full path), the third is cached.
    assert got["relayout_full_calls"] == 2, got
    assert got["relayout_diff"] <= TOL, got


def test_factored_on_shards(results):
    """Adafactor's factored leaves split along one dim (uneven Shard(0), a rank with no
    row, Shard(1), 3-D, HSDP) equal one process over 12 steps: the partial row or column
    sums and the update's RMS go over the ranks. The statistic that keeps the split dim is
    sharded as the leaf, the summed one replicated; a DCP round trip resumes bit-exactly."""
    got = _check(results, "factored")
    for backend in [k[:-len("_diff")] for k in got if k.endswith("_diff")
                    and k != "resumed_diff" and not k.endswith("state_diff")]:
        assert got[f"{backend}_moved"] > 1e-3, got
        assert got[f"{backend}_diff"] <= TOL and got[f"{backend}_state_diff"] <= TOL, got
    assert "eager_diff" in got
    # (v_row, v_col) placements: Shard(0) of w splits d1 (its rows), of t d0; Shard(1)
    # of c splits d0 (its columns).
    assert got["placements"] == {"w": ["(Shard(dim=0),)", "(Replicate(),)"],
                                 "t": ["(Replicate(),)", "(Shard(dim=0),)"],
                                 "c": ["(Replicate(),)", "(Shard(dim=0),)"]}, got
    # HSDP: t split over both mesh dims of a (1, 2) mesh (v_row replicated on both).
    assert "hsdp_diff" in got
    assert got["partition_update"] <= TOL, got
    assert got["hsdp_placements"] == ("(Replicate(), Replicate(), Shard(dim=0), "
                                      "Shard(dim=0))"), got
    assert got["resumed_diff"] == 0.0, got


def test_ddp_replicas_bit_identical(results):
    assert _check(results, "ddp")["replicas_equal"]


def test_dcp_resume_bit_exact(results):
    got = _check(results, "dcp")
    for name in ("adamw", "adamw_8bit"):
        assert got[f"{name}_params_loaded"]
        assert got[f"{name}_resumed_diff"] == 0.0


def test_optimizer_on_fsdp2(results):
    got = _check(results, "optimizer")
    assert got["diff"] <= TOL, got
    assert got["state_is_dtensor"]
    assert got["loaded_diff"] == 0.0 and got["resumed_diff"] == 0.0, got


def test_matrix_stages_on_shards(results):
    got = _check(results, "matrix_stages")
    assert got["rows_eager_diff"] <= TOL and got["replicate_diff"] <= TOL, got
    assert got.get("rows_fused_diff", 0.0) <= TOL, got
    assert got["block_rms_sharded_diff"] <= TOL, got
    for key in [k for k in got if k.startswith("experts_") and k.endswith("_diff")]:
        assert got[key] <= TOL, (key, got[key])
    for key in [k for k in got if k.startswith("experts_split_") and "untouched" not in k]:
        assert got[key] is not None and "at ['w']" in got[key], (key, got[key])
        assert "splitting dim 1, which is not a batch axis" in got[key], got[key]
        assert got[key + "_untouched"], key
    assert "experts_eager_diff" in got, got
    assert got["normuon_replicate_diff"] <= TOL, got
    assert got["normuon_split"] is not None and "at ['w']" in got["normuon_split"], got
    assert "(Shard(dim=0),)" in got["normuon_split"], got["normuon_split"]
    assert got["soap_replicate_diff"] <= TOL, got
    assert got["soap_split"] is not None and "at ['w']" in got["soap_split"], got
    for key in [k for k in got if k.endswith("_error")]:
        assert got[key] is not None, key
        assert "at ['w']" in got[key] and "sharded with placements" in got[key], got[key]
        assert got[key.replace("_error", "_untouched")], key
        if key.startswith("shard1"):
            assert "(Shard(dim=1),)" in got[key] and "reads each row" in got[key]
        else:
            assert "Replicate only" in got[key], got[key]


def test_monitoring_on_shards_measures_whole_leaves(results):
    """snapshot and monitor over FSDP2's Shard(0) leaves: the norm of the whole tree, a
    per-element copy of a sharded leaf's update and an average of a bool measure equal
    one process' (eager and fused; donated, and not donated through the call cache), and
    the params step as there."""
    got = _check(results, "monitor")
    keys = [k for k in got if k.endswith("_params_diff")]
    assert {k.split("_")[0] for k in keys} >= {"eager"}, got
    for key in keys:
        assert got[key] <= TOL, (key, got)
        stem = key[:-len("_params_diff")]
        assert got[f"{stem}_norm"] > 0.02, got  # (the clip acts: "large" is not all 0)
        for name in ("norm", "large", "emb"):
            assert got[f"{stem}_{name}_diff"] <= TOL, (stem, name, got)
            assert got[f"{stem}_kept_{name}_diff"] <= TOL, (stem, name, got)


def test_dcp_scalar_states_across_ranks(results):
    """States with 0-d tensors (a step count, Schedule-Free's running scalars, NovoGrad's
    per-leaf second moments): a one-process checkpoint loads on two ranks bit for bit and
    resumes as one process does (the other way: test_dcp_loads_on_one_process)."""
    got = _check(results, "dcp_scalars")
    for name, scalars in (("noisy_sgd", 1), ("schedule_free", 3), ("novograd", 3)):
        assert got[f"{name}_scalars"] >= scalars, got  # (0-d leaves the state holds)
        assert got[f"{name}_diff"] == 0.0, got
        assert got[f"{name}_state_loaded"], got
        assert got[f"{name}_resumed_diff"] == 0.0, got


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "noisy_sgd", "schedule_free",
                                  "novograd"])
def test_dcp_loads_on_one_process(results, name):
    """The checkpoint of two ranks, loaded without a process group into a plain state,
    equals the single-process run's state bit for bit."""
    import distributed_checks
    import torch.distributed.checkpoint as dcp

    directory = results["_directory"]
    ref = torch.load(os.path.join(directory, f"ref_{name}.pt"), weights_only=True)
    params = {k: torch.zeros_like(v) for k, v in ref["params"].items()}
    tx = {**distributed_checks.CHAINS, **distributed_checks.SCALAR_CHAINS}[name]()
    state = tx.init(params)
    sd = {"opt": ftopt.state_dict(state, tx, params), "model": params}
    dcp.load(sd, checkpoint_id=os.path.join(directory, f"dcp_{name}"), no_dist=True)
    state = ftopt.load_state_dict(state, tx, params, sd["opt"])
    for k in params:
        assert torch.equal(params[k], ref["params"][k]), k
    got = ftopt.tree.leaves(state)
    want = ftopt.tree.leaves(ref["state"])
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_noise_on_shards_equals_one_process(results):
    """noisy_sgd over Shard(0) (uneven), HSDP and Replicate leaves draws the noise of one
    process bit for bit (eager, fused, tx.update); Shard(1) is refused, naming the leaf
    and its placements, before the params or the count change."""
    got = _check(results, "noise")
    _assert_equals_one_process_and_refuses_shard1(got, "add_noise at ['w']")
    for key in [k for k in got if k.endswith("_error")]:
        assert "(Shard(dim=1),)" in got[key], got[key]


def _assert_equals_one_process_and_refuses_shard1(got: dict, names: str) -> None:
    """The sharded runs' differences from one process are 0 (update, eager and fused);
    every Shard(1) run raised an error naming ``names`` before the params or the count
    changed."""
    for key in [k for k in got if k.endswith("_diff")]:
        assert got[key] == 0.0, (key, got[key])
    assert "shard0_update_diff" in got and "hsdp_eager_diff" in got
    for key in [k for k in got if k.endswith("_error")]:
        error = got[key]
        assert error is not None and names in error, (key, error)
        assert got[key.replace("_error", "_untouched")]
        assert got[key.replace("_error", "_count")] == 0


def test_stochastic_rounding_on_shards_equals_one_process(results):
    """AdamW with stochastically rounded bf16 states over Shard(0) (uneven), HSDP and
    Replicate leaves: the params of one process bit for bit (the dither hashes the
    element's position in the full tensor); Shard(1) is refused before anything changes."""
    got = _check(results, "stochastic_rounding")
    _assert_equals_one_process_and_refuses_shard1(got, "scale_by_adam at ['w']")


@pytest.mark.parametrize("shape, local, start, want", [
    ((5, 6), (3, 6), (0, 0), 0),
    ((5, 6), (2, 6), (3, 0), 18),  # the second of an uneven Shard(0)
    ((7,), (3,), (4,), 4),
    ((1, 6), (1, 3), (0, 3), 3),  # Shard(1) of one row: still one run
    ((4, 6), (4, 3), (0, 3), None),  # Shard(1): every row split
    ((4, 6), (2, 3), (2, 3), None),  # split on two dims
    ((4, 6), (0, 6), (4, 0), 0),  # an empty shard
    ((4, 6), (4, 6), (0, 0), 0),
])
def test_flat_offset(shape, local, start, want):
    assert ftopt.shards.flat_offset(shape, local, start) == want


@pytest.mark.parametrize("backend", ["eager", "fused"])
def test_factored_split_on_two_dims_refused(backend):
    """A factored leaf whose shards split both factored dims (a 2-D mesh sharding rows
    and columns) is refused before anything is written, naming the leaf and its
    placements (one process: the call's context says what the shards are)."""
    from torch.distributed.tensor import Shard

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 6, device=device), "b": torch.randn(6, device=device)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = ftopt.adafactor(1e-2, min_dim_size_to_factor=2)
    state = tx.init(params)
    before = [t.clone() for t in ftopt.tree.leaves((params, state))]
    context = ftopt.shards.LocalShards(
        splits={"['w']": ((Shard(0), Shard(1)), frozenset({0, 1}))},
        shapes={"['w']": (8, 12)})
    with ftopt.shards.local_shards(context), pytest.raises(ValueError) as err:
        ftopt.step(tx, params, grads, state, donate=True, backend=backend)
    message = str(err.value)
    assert "scale_by_factored_rms at ['w']" in message, message
    assert "(Shard(dim=0), Shard(dim=1))" in message and "splitting dims [0, 1]" in message
    after = ftopt.tree.leaves((params, state))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
