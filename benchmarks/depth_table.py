"""docs/depth.md's tables from a ``pyterrier-prob depth`` results file (``--results-json``): no measurement, only the
JSON's rows of one collection, printed as the run's ``results.md`` prints them.

    python benchmarks/depth_table.py --table benchmarks/results/rerank_depth.json --collection irds:beir/nfcorpus
"""

from __future__ import annotations

import argparse
import json

from pyterrier_prob.experiments.depth import rule_table
from pyterrier_prob.experiments.harness import markdown_table


def table(path: str, collection: str) -> str:
    """The rule table of ``collection`` in the results file ``path`` as Markdown."""
    with open(path, encoding="utf8") as f:
        rows = json.load(f)["rows"]
    mine = [r for r in rows if r["collection"] == collection]
    if not mine:
        have = sorted({r["collection"] for r in rows})
        raise ValueError(f"{path}: no rows of collection {collection!r} (it has {have})")
    return markdown_table(rule_table(mine))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", metavar="JSON", required=True, help="a pyterrier-prob depth results file")
    ap.add_argument("--collection", required=True, help="the collection's label, e.g. irds:beir/nfcorpus")
    args = ap.parse_args(argv)
    print(table(args.table, args.collection))


if __name__ == "__main__":
    main()
