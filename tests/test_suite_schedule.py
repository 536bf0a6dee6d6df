"""benchmarks/suite_schedule.py: xdist's work stealing simulated; and the conftest's deal
of the collection order over the processes where single tests are handed out."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import suite_schedule as ss  # noqa: E402

CASES = [
    # Two processes, four tests each: the second, with one test left at 3 s, takes the
    # last two of the first's (which keeps its running test and one more).
    ([10, 1, 1, 1, 1, 1, 1, 1], 11),
    ([1] * 8, 4),
    # A queue of two is not stolen from: as collected the two long tests run one after
    # the other; dealt round-robin, side by side.
    ([5, 5, 1, 1], 10),
    ([5, 1, 5, 1], 6),
]


@pytest.mark.parametrize("costs, seconds", CASES)
def test_simulate(costs, seconds):
    assert ss.simulate(costs, 2) == seconds


def test_worksteal_deals_the_collection_order():
    # (the cases above on two processes: dealt, the first runs cases 0 and 2, the second
    # 1 and 3; a queue of two is never stolen from)
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist=worksteal", "-p",
         "no:cacheprovider", "-p", "no:randomly", f"{__file__}::test_simulate"],
        check=True, capture_output=True, text=True, cwd=ROOT).stdout
    by = {}
    for worker, case in re.findall(r"\[(gw\d)\].*PASSED .*::test_simulate\[(\S+)\]", ran):
        by.setdefault(worker, []).append(case)
    ids = [f"costs{k}-{s}" for k, (_, s) in enumerate(CASES)]
    assert sorted(by.values()) == [ids[0::2], ids[1::2]], ran
