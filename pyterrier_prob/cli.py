"""The ``pyterrier-prob`` command: one subcommand per paper's experiment, on any collection.

``pyterrier-prob pebr|mol|varce|unierf [options]`` runs :mod:`pyterrier_prob.experiments.<paper>`; each has its own
``--help``. Plain ``pyterrier-prob [options]`` runs the pEBR experiment. At default verbosity the console shows our
progress bars and the final table only; ``--verbose`` keeps the libraries' own output (:mod:`pyterrier_prob.console`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pyterrier_prob.console import setup_console

#: Subcommand -> module of :mod:`pyterrier_prob.experiments` (each has DESCRIPTION, add_arguments,
#: config_from_args, run).
PAPERS = {
    "pebr": "pyterrier_prob.experiments.pebr",
    "mol": "pyterrier_prob.experiments.mol",
    "varce": "pyterrier_prob.experiments.varce",
    "unierf": "pyterrier_prob.experiments.unierf",
}
DEFAULT = "pebr"


def build_parser(paper: str = DEFAULT) -> argparse.ArgumentParser:
    """The parser of one subcommand (``pyterrier-prob <paper>``)."""
    mod = importlib.import_module(PAPERS[paper])
    others = ", ".join(f"'pyterrier-prob {p} --help'" for p in PAPERS)
    ap = argparse.ArgumentParser(
        prog=f"pyterrier-prob {paper}",
        description=mod.DESCRIPTION,
        epilog=f"Experiments: {', '.join(PAPERS)} (plain 'pyterrier-prob' runs '{DEFAULT}'). See {others}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    mod.add_arguments(ap)
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="also show the libraries' own output: ir_datasets' INFO lines, sentence-transformers' inner bars "
        "(Batches, Computing widget examples), Hugging Face's loading bars and torch's pin_memory warning",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run ``pyterrier-prob [paper] [options]``; the exit status (2 for a bad setting or input, with a message)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    paper = argv.pop(0) if argv and argv[0] in PAPERS else DEFAULT
    a = build_parser(paper).parse_args(argv)
    setup_console(verbose=a.verbose)  # our bars and the table only, unless --verbose
    mod = importlib.import_module(PAPERS[paper])
    try:
        cfg = mod.config_from_args(a)
        cfg.check()
    except ValueError as e:
        print(f"pyterrier-prob {paper}: {e}", file=sys.stderr)
        return 2
    try:
        mod.run(cfg)
    except (ValueError, FileNotFoundError) as e:  # bad collections, splits or models: a message, not a traceback
        print(f"pyterrier-prob {paper}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
