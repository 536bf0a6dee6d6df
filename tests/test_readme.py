"""The README's examples run as written."""

import pathlib

import torch

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
