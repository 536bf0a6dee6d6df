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
               MASTER_PORT=str(port), PYTHONPATH=str(root))
    script = tmp_path / "fsdp2_example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "steps 3" in done.stdout
