"""Prints the tests whose outcome differs between two JUnit XML reports (DeepSpeed's engine,
then nvcomp_ckpt_engine), with the first line of each failure's message; exits 1 if any differ."""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, first line of its message)."""
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip().splitlines()[:1]
                message = message[0][:200] if message else ""
                break
        result[name] = (outcome, message)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("baseline", help="JUnit XML of the run with DeepSpeed's own engine")
    parser.add_argument("engine", help="JUnit XML of the run with nvcomp_ckpt_engine turned on")
    args = parser.parse_args()
    base, ours = outcomes(args.baseline), outcomes(args.engine)
    differ = sorted(n for n in base.keys() | ours.keys() if base.get(n, ("absent",))[0] != ours.get(n, ("absent",))[0])
    counts = {k: sum(1 for o, _ in v.values() if o == "passed") for k, v in (("deepspeed", base), ("nvcomp", ours))}
    print(f"{len(base)} tests; passed: DeepSpeed's engine {counts['deepspeed']}, nvcomp_ckpt_engine {counts['nvcomp']}")
    for name in differ:
        (b, _), (o, message) = base.get(name, ("absent", "")), ours.get(name, ("absent", ""))
        print(f"DIFFERS {name}: {b} -> {o}" + (f"  ({message})" if message else ""))
    if not differ:
        print("no test's outcome differs")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
