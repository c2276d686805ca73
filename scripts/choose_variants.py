"""Turns a GPU run's variant timings (benchmarks/variants.py --json) and test
results (scripts/gpu_check.sh's gpu-tests.xml) into the choice for each CUDA
variant, per shape class and dtype:

    python scripts/choose_variants.py variants.json [--tests gpu-tests.xml] [--json choice.json]

A shape class is the layout and the tensor's size: ``small`` under 1 MiB (a
small layer: host time and launches), ``medium`` under 64 MiB, ``large`` from
64 MiB (bandwidth). A variant is chosen for a class and dtype when its tests
passed (every test id naming it in the junit file; without --tests, nothing is
chosen), no case there is slower than ``--floor`` (default 0.99x: the timer's
noise), their median is at least ``--gain`` (default 1.01x), and the
ResNet-50 step with it is not slower than the floor. The output lists every
class with its cases' median and worst speedup and the verdict; with --json,
the table as a file to commit beside the results it came from. A variant
chosen everywhere becomes the default (its switch is removed); one chosen
nowhere is deleted; one chosen in some classes becomes the default there
(docs/design.md, "CUDA variants").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
SMALL, LARGE = 1 << 20, 64 << 20


def shape_class(case: dict) -> str:
    numel = 1
    for s in case["shape"]:
        numel *= s
    nbytes = numel * ELEMENT_BYTES[case["dtype"]]
    size = "small" if nbytes < SMALL else "medium" if nbytes < LARGE else "large"
    return f"{case['layout']}/{size}"


def tests_passed(junit: Path, variant: str) -> tuple[bool, int]:
    """Whether every test whose id names `variant` passed, and how many ran."""
    ran, failed = 0, 0
    for case in ET.parse(junit).getroot().iter("testcase"):
        if variant not in case.get("name", ""):
            continue
        ran += 1
        failed += any(child.tag in ("failure", "error") for child in case)
    return ran > 0 and failed == 0, ran


def choose(report: dict, junit: Path | None, floor: float, gain: float) -> dict:
    choice = {"source": {k: report.get(k) for k in ("device", "torch", "commit", "date")}, "variants": {}}
    for variant, entry in report["variants"].items():
        green, ran = tests_passed(junit, variant) if junit and junit.exists() else (False, 0)
        model = entry.get("model")
        model_ok = model is None or model["speedup"] >= floor
        groups: dict[tuple[str, str], list[float]] = {}
        for case in entry["cases"]:
            groups.setdefault((shape_class(case), case["dtype"]), []).append(case["speedup"])
        classes = {}
        for (cls, dtype), speedups in sorted(groups.items()):
            median, worst = statistics.median(speedups), min(speedups)
            chosen = green and model_ok and worst >= floor and median >= gain
            classes[f"{cls}/{dtype}"] = {"cases": len(speedups), "median": round(median, 4),
                                         "worst": round(worst, 4), "chosen": chosen}
        chosen = [k for k, v in classes.items() if v["chosen"]]
        verdict = ("default everywhere" if chosen and len(chosen) == len(classes) else
                   "delete (chosen nowhere)" if not chosen else f"default in {len(chosen)} of {len(classes)} classes")
        choice["variants"][variant] = {"tests_green": green, "tests_ran": ran, "model": model, "classes": classes,
                                       "verdict": verdict}
    return choice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--tests", type=Path, help="junit XML of the GPU tests (gpu_check.sh's gpu-tests.xml)")
    parser.add_argument("--floor", type=float, default=0.99)
    parser.add_argument("--gain", type=float, default=1.01)
    parser.add_argument("--json", type=Path, help="write the choice here")
    args = parser.parse_args()
    choice = choose(json.loads(args.results.read_text()), args.tests, args.floor, args.gain)
    src = choice["source"]
    print(f"{src['device']}; torch {src['torch']}; commit {src['commit']}; {src['date']}")
    for variant, v in choice["variants"].items():
        tests = f"tests {'green' if v['tests_green'] else 'NOT green'} ({v['tests_ran']} ran)"
        model = v["model"]
        step = f", ResNet-50 step {model['speedup']:.3f}x" if model else ""
        print(f"\n{variant}: {tests}{step} -> {v['verdict']}")
        for cls, c in v["classes"].items():
            print(f"  {cls:36s} {c['cases']:3d} cases  median {c['median']:.3f}x  worst {c['worst']:.3f}x  "
                  f"{'chosen' if c['chosen'] else '-'}")
    if args.json:
        args.json.write_text(json.dumps(choice, indent=1) + "\n")
    if not (args.tests and args.tests.exists()):
        print("\n(no test results: nothing is chosen before the variant's tests are seen green)", file=sys.stderr)


if __name__ == "__main__":
    main()
