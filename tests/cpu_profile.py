"""A pytest plugin: CPU seconds per test, its own and those of the processes it started.

    PYTHONPATH=tests CPU_PROFILE=/tmp/cpu.jsonl python -m pytest -q -p cpu_profile

The suite is CPU-bound on 2 cores, so its time budget is spent in CPU seconds, and `--durations`
(wall time, while the other pytest worker competes for the cores) cannot say which tests spend
them. Appends one JSON line per test to $CPU_PROFILE: its nodeid, "self" (the pytest worker's
user + system seconds during the test, every thread), "children" (those of the processes it
started and waited for, their own children included) and "wall". A module fixture's cost lands on
the first test that uses it; the shared launched group's on the first of its readers.

    python3 -c "import json; rows = [json.loads(line) for line in open('/tmp/cpu.jsonl')]; \\
        print(sum(row['self'] + row['children'] for row in rows))"
"""

import json
import os
import resource
import time

import pytest


def _cpu_seconds() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own, children = _cpu_seconds()
    started = time.time()
    yield
    own_after, children_after = _cpu_seconds()
    row = {
        "id": item.nodeid,
        "self": own_after - own,
        "children": children_after - children,
        "wall": time.time() - started,
    }
    # One line per write, appended: the pytest workers of -n share the file.
    with open(os.environ.get("CPU_PROFILE", "cpu_profile.jsonl"), "a") as file:
        file.write(json.dumps(row) + "\n")
