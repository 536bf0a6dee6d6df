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


def test_readme_optimizer_example_runs():
    code = _snippet("## Use with torch.optim")
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
    exec(compile(_snippet("## Use with Hugging Face's Trainer"), "README.md", "exec"),
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
