"""Compare two pytest runs' test times, test by test: the tests both runs have, and the rest.

Tests are matched by their name with its parameters (``test_x[a]``), not their file, so a
test that moved to another module is still the same test. A JUnit XML from pytest
(``--junitxml``) gives each test's setup, call and teardown together. Prints, for the
tests in both runs, their total time in each and the ratio, then the tests only one run
has, and the ten whose time changed most.

    python -m pytest -q tests/runtime --junitxml=before.xml   # on the old tree
    python -m pytest -q tests/runtime --junitxml=after.xml    # on this one
    python scripts/compare_test_times.py before.xml after.xml
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict


def test_times(path: str) -> tuple[dict[str, float], dict[str, str]]:
    """Seconds per test name (summed where two files have one name), and each name's outcome."""
    times: dict[str, float] = defaultdict(float)
    outcomes: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        times[name] += float(case.get("time", 0.0))
        kinds = {child.tag for child in case}
        outcomes[name] = "skipped" if "skipped" in kinds else "failed" if kinds & {"failure", "error"} else "passed"
    return dict(times), outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    args = ap.parse_args()
    before, before_outcome = test_times(args.before)
    after, after_outcome = test_times(args.after)
    common = sorted(set(before) & set(after))
    passed_in_both = [n for n in common if before_outcome[n] == after_outcome[n] == "passed"]
    tb, ta = sum(before[n] for n in passed_in_both), sum(after[n] for n in passed_in_both)
    print(f"before: {len(before)} tests, {sum(before.values()):.1f} s; after: {len(after)} tests, {sum(after.values()):.1f} s")
    print(f"in both, passed in both: {len(passed_in_both)} tests: before {tb:.1f} s, after {ta:.1f} s, "
          f"{tb / ta if ta else float('inf'):.2f}x")
    only_before = sorted(set(before) - set(after))
    only_after = sorted(set(after) - set(before))
    print(f"only before: {len(only_before)} tests, {sum(before[n] for n in only_before):.1f} s; "
          f"only after: {len(only_after)} tests, {sum(after[n] for n in only_after):.1f} s")
    for n in sorted(only_after, key=lambda n: -after[n])[:5]:
        print(f"  new: {after[n]:7.1f} s  {n}")
    print("largest changes among the tests in both:")
    for n in sorted(passed_in_both, key=lambda n: -abs(before[n] - after[n]))[:10]:
        print(f"  {before[n]:7.1f} s -> {after[n]:7.1f} s  {n}")


if __name__ == "__main__":
    main()
