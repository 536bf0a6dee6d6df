"""The README's example runs as written."""

import pathlib


def test_readme_example_runs():
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    start = text.index("```python") + len("```python")
    code = text[start:text.index("```", start)]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["params"]["w"].shape == (512, 256)
    assert int(namespace["state"][1][0].count) == 2  # two steps of scale_by_adam
