"""docs/pebr.md's per-query cutoff tables from a ``pyterrier-prob pebr`` results file (``--results-json``): no
measurement, only the JSON's ``tables``, printed as the run's ``results.md`` prints them.

    python benchmarks/pebr_tables.py --table benchmarks/results/pebr_frozen.json            # matched mean depth
    python benchmarks/pebr_tables.py --table benchmarks/results/pebr_frozen.json --part table1

Both compare with top-k at a system's own test mean depth (interpolated per query between the neighbouring k), with
the paired t-test's p; Table 1's ``*`` marks, as the paper compares, are against pEBR top-k at k."""

from __future__ import annotations

import argparse
import json

import pandas as pd

from pyterrier_prob.experiments.harness import markdown_table
from pyterrier_prob.experiments.pebr import table1
from pyterrier_prob.experiments.pebr_cutoffs import matched_table

PARTS = {"table1": ("results", table1), "matched": ("cutoffs_matched_depth", matched_table)}


def table(path: str, part: str = "matched") -> str:
    """The ``part`` table of the results file ``path`` as Markdown."""
    with open(path, encoding="utf8") as f:
        tables = json.load(f)["tables"]
    key, render = PARTS[part]
    if not isinstance(tables.get(key), list):
        raise ValueError(f"{path}: tables.{key} holds no rows (a results JSON of `pyterrier-prob pebr`?)")
    return markdown_table(render(pd.DataFrame(tables[key])))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", metavar="JSON", required=True, help="a pyterrier-prob pebr results file")
    ap.add_argument("--part", choices=sorted(PARTS), default="matched", help="which table")
    args = ap.parse_args(argv)
    print(table(args.table, args.part))


if __name__ == "__main__":
    main()
