"""The README's examples run as written."""

import pathlib

import pytest
import torch

import ftopt

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text()


def _snippet(after: str = "") -> str:
    """The first python block after the text ``after``."""
    start = README.index("```python", README.index(after)) + len("```python")
    return README[start:README.index("```", start)]


def test_readme_example_runs():
    code = _snippet()
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["params"]["w"].shape == (512, 256)
    assert int(namespace["state"][1][0].count) == 2  # two steps of scale_by_adam


def _run(after: str) -> dict:
    namespace: dict = {}
    exec(compile(_snippet(after), "README.md", "exec"), namespace)
    return namespace


def test_readme_plain_loop_runs():
    torch.manual_seed(0)
    namespace = _run("### A plain loop")
    model, params = namespace["model"], namespace["params"]
    assert int(namespace["state"][0].count) == 50
    for name, p in model.named_parameters():
        assert params[name] is p  # donated: the model's own tensors, written in place
    x = torch.randn(256, 16)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    assert loss < 0.5 * x.sum(1).var()  # it learned


def test_readme_torch_func_example_runs():
    torch.manual_seed(0)
    namespace = _run("### torch.func")
    loss = namespace["loss_fn"](namespace["params"])
    assert loss < 0.9 * namespace["first"]
    assert int(namespace["state"][0].count) == 100


def test_readme_optimizer_closure_example_runs():
    torch.manual_seed(0)
    losses = _run("Transforms that read the loss")["losses"]
    assert losses[-1] < 0.5 * losses[0]


def test_readme_torch_porting_example_runs():
    namespace = _run("### Porting a checkpoint")
    opt, state, back = namespace["torch_opt"], namespace["state"], namespace["back"]
    weight = namespace["model"].weight
    assert torch.equal(state[0].mu["weight"], opt.state[weight]["exp_avg"])
    assert int(state[0].count) == 3
    assert torch.equal(back["state"][0]["exp_avg_sq"], opt.state[weight]["exp_avg_sq"])


def test_readme_bnb_porting_example_runs():
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    namespace = _run("bitsandbytes' Adam and AdamW, 8-bit blockwise or 32-bit")
    opt, state = namespace["bnb_opt"], namespace["state"]
    weight = namespace["model"].weight
    assert torch.equal(state[0].mu["weight"].codes, opt.state[weight]["state1"])
    assert state[0].mu["bias"].dtype == torch.float32
    assert opt.state[weight]["step"] == 3 and int(state[0].count) == 3


def test_readme_optimizer_example_runs():
    code = _snippet("### nn.Module and torch's optimizer API")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    opt, sched, checkpoint = namespace["opt"], namespace["sched"], namespace["checkpoint"]
    assert isinstance(opt, torch.optim.Optimizer)
    assert sched.last_epoch == 20 and opt.param_groups[0]["lr"] == sched.get_last_lr()[0]
    state = opt.state_dict()["state"]
    assert len(state) == 4 and all(int(s["step"]) == 20 for s in state.values())
    weight = namespace["model"][0].weight
    assert torch.equal(opt.state[weight]["mu"], checkpoint["opt"]["state"][0]["mu"])
    assert opt.state[weight]["mu"].abs().sum() > 0


def test_readme_trainer_recipe_runs(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="Trainer needs accelerate, not installed")
    monkeypatch.chdir(tmp_path)  # it writes under build/
    namespace: dict = {}
    exec(compile(_snippet("### Hugging Face's Trainer"), "README.md", "exec"),
         namespace)
    assert namespace["trainer"].state.global_step == 4
    assert int(namespace["opt"].state_dict()["state"][0]["step"]) == 4


def test_readme_lightning_recipe_runs(tmp_path, monkeypatch):
    pytest.importorskip("lightning", reason="lightning is not installed")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(_snippet("In Lightning, `configure_optimizers`"), "README.md", "exec"),
         namespace)
    trainer = namespace["trainer"]
    assert trainer.global_step == 4 and isinstance(trainer.optimizers[0], ftopt.Optimizer)


def test_readme_fsdp2_example_runs(tmp_path):
    """The multi-GPU example, as torchrun would start it with one process (gloo)."""
    import os
    import socket
    import subprocess
    import sys

    code = _snippet("## Multi-GPU") + (
        "from torch.distributed.tensor import DTensor\n"
        "assert all(isinstance(p, DTensor) for p in params.values())\n"
        "assert all(isinstance(t, DTensor) for t in ftopt.tree.leaves(state) if t.ndim)\n"
        "print('steps', int(ftopt.tree.leaves(state)[0]))\n"
        "dist.destroy_process_group()\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = pathlib.Path(__file__).parent.parent
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join(x for x in (str(root), os.environ.get("PYTHONPATH"))
                                          if x))
    script = tmp_path / "fsdp2_example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "steps 3" in done.stdout
