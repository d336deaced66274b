"""Print a failed test run's recap from pytest's JUnit XML: each failing test id, then its report.

pytest prints every failure as it finishes, but a CI log is often read from its tail, where a
long rank traceback can push the ids out of view. This recap comes last: the ids first (what to
rerun), then each failure's message and traceback, cut to ``--lines`` lines a test.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET


def failures(path: str) -> list[tuple[str, str]]:
    """(test id, report) for every failed or erroring test case in the JUnit XML file."""
    found = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for outcome in ("failure", "error"):
            for element in case.iter(outcome):
                found.append((f"{_test_id(case)} ({outcome})", element.text or ""))
    return found


def _test_id(case: ET.Element) -> str:
    """pytest's node id from the xunit1 attributes: ``file``, then any class, then the name."""
    classname, name = case.get("classname", ""), case.get("name", "")
    path = case.get("file") or classname.replace(".", "/") + ".py"
    module = path.removesuffix(".py").replace("/", ".")
    test_class = classname.removeprefix(module).lstrip(".")
    return "::".join(part for part in (path, test_class, name) if part)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml")
    parser.add_argument("--lines", type=int, default=120, help="report lines shown per test")
    args = parser.parse_args()
    try:
        found = failures(args.junit_xml)
    except (OSError, ET.ParseError) as exc:
        print(f"no test report to summarise ({exc})")
        return 0
    if not found:
        return 0
    print(f"\n==== {len(found)} failing test(s) ====")
    print("\n".join(test_id for test_id, _ in found))
    for test_id, report in found:
        lines = report.rstrip().splitlines()
        shown = lines[-args.lines :]
        print(f"\n---- {test_id} ----")
        if len(lines) > len(shown):
            print(f"[... {len(lines) - len(shown)} earlier lines ...]")
        print("\n".join(shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
