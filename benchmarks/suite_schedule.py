"""How long the test suite runs on N processes under pytest-xdist's work stealing, by
simulation from the tests' times in junit files, for the order pytest collects (the
file order of ``tests/conftest.py``'s LONGEST_FIRST) and for that order dealt
round-robin over the processes (what the conftest does under ``--dist worksteal``).

The simulation follows xdist's ``WorkStealingScheduling``: each idle process (fewer than
two tests queued, its running one included) takes an even share of the tests not yet
handed out; once none are left, an idle process takes the last half of the longest
queue. Messages take no time. A test's time is from the first junit file that has it
(else the median of all), so list the run nearest the one to predict first.

    pytest --co -q tests/ | grep :: > ids.txt
    python3 benchmarks/suite_schedule.py ids.txt JUNIT [JUNIT ...] [--workers=16]

(``results/gpu_suite_junit_*.xml.gz``: the GPU suite's junit files.)
"""
from __future__ import annotations

import argparse
import gzip
import heapq
import statistics
import xml.etree.ElementTree as ET

MIN_PENDING = 2  # (xdist's worksteal: a process with fewer queued asks for more)


def junit_times(path: str) -> dict[str, float]:
    """Node id -> seconds, of each test a junit file (or its gzip) timed."""
    out = {}
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        cases = list(ET.parse(f).iter("testcase"))
    for case in cases:
        module = case.get("classname")
        if module and module != "pytest":  # (pytest's own "internal" error case)
            out[module.replace(".", "/") + ".py::" + case.get("name")] = float(
                case.get("time", 0))
    return out


def simulate(costs: list[float], workers: int) -> float:
    """Seconds until the last of ``costs`` (in the order handed out) ends."""
    pending = list(range(len(costs)))
    queues: list[list[int]] = [[] for _ in range(workers)]
    running: set[int] = set()
    ended: set[int] = set()
    events: list[tuple[float, int]] = []
    now = 0.0

    def start(w: int) -> None:
        if queues[w] and w not in running:
            running.add(w)
            heapq.heappush(events, (now + costs[queues[w][0]], w))

    def check() -> None:
        up = [w for w in range(workers) if w not in ended]
        idle = [w for w in up if len(queues[w]) < MIN_PENDING]
        if not idle:
            return
        if pending:
            for i, w in enumerate(idle):
                n = len(pending) // (len(idle) - i)
                queues[w].extend(pending[:n])
                del pending[:n]
                start(w)
            idle = [w for w in up if len(queues[w]) < MIN_PENDING]
            if not idle:
                return
        source = max(up, key=lambda w: len(queues[w]))
        n = min(len(queues[source]) // 2, max(0, len(queues[source]) - MIN_PENDING))
        if n == 0:
            ended.update(idle)  # (they run what they hold, then stop)
            return
        pending.extend(queues[source][-n:])
        del queues[source][-n:]
        check()

    check()
    while events:
        now, w = heapq.heappop(events)
        running.discard(w)
        queues[w].pop(0)
        start(w)
        check()
    return now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", help="node ids in collection order, one a line")
    parser.add_argument("junit", nargs="+")
    parser.add_argument("--workers", type=int, default=16)
    args = parser.parse_args()
    order = [line.strip() for line in open(args.ids) if "::" in line]
    runs = [junit_times(p) for p in args.junit]
    median = statistics.median([t for run in runs for t in run.values()] or [0.0])
    cost = {i: next((run[i] for run in runs if i in run), median) for i in order}
    untimed = sum(all(i not in run for run in runs) for i in order)
    n = args.workers
    dealt = [i for k in range(n) for i in order[k::n]]
    total = sum(cost.values())
    print(f"{len(order)} tests ({untimed} untimed, {median:.2f} s each), {total:.0f} s in "
          f"all; {n} processes: at least {max(total / n, max(cost.values())):.0f} s")
    print("| order | predicted s |\n| --- | ---: |")
    for name, ids in (("as collected", order), ("dealt round-robin", dealt)):
        print(f"| {name} | {simulate([cost[i] for i in ids], n):.0f} |")


if __name__ == "__main__":
    main()
