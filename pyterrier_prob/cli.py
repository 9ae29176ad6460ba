"""The ``pyterrier-prob`` command: ``pyterrier-prob pebr|mol|varce|unierf [options]`` runs
:mod:`pyterrier_prob.experiments.<paper>` on any collection (plain ``pyterrier-prob [options]``: pEBR); ``--verbose``
keeps the libraries' own output (:mod:`pyterrier_prob.console`)."""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
from collections.abc import MutableMapping

from pyterrier_prob import __version__
from pyterrier_prob.console import setup_console

#: Subcommand -> the line ``pyterrier-prob --help`` lists it with.
COMMANDS = {
    "pebr": "pEBR: probabilistic bi-encoder; CDF cutoff against top-k and score cutoff at matched mean depth",
    "mol": "Mixture-of-Logits: learned similarity against the dot-product bi-encoder, and its gate",
    "varce": "VarCrossEncoder: uncertainty-aware cross-encoder re-ranking of BM25 candidates",
    "unierf": "UniERF: two-branch query towers, merged recall at budget B, Table 2 ablation, branch overlap",
    "depth": "per-query re-ranking depth: rules fitted on dev against fixed-k on the cost-effectiveness curve",
}
#: Subcommand -> module of :mod:`pyterrier_prob.experiments` (DESCRIPTION, add_arguments, config_from_args, run).
PAPERS = {paper: f"pyterrier_prob.experiments.{paper}" for paper in COMMANDS}
DEFAULT = "pebr"
#: Environment variables that already choose how OpenMP's idle threads wait: :func:`passive_waiting` leaves them.
OMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help followed by its default, unless the help says it or the default is None or False."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        return text if action.default is False else f"{text} (default: %(default)s)"


def build_parser(paper: str = DEFAULT, commands: bool = False) -> argparse.ArgumentParser:
    """The parser of one subcommand (``pyterrier-prob <paper>``); with ``commands``, that of plain
    ``pyterrier-prob``: the list of subcommands, then the options of the one it runs (``paper``)."""
    mod = importlib.import_module(PAPERS[paper])
    if commands:
        width = max(map(len, COMMANDS))
        listing = "\n".join(f"  {name:<{width}}  {line}" for name, line in COMMANDS.items())
        kwargs = {
            "prog": "pyterrier-prob",
            "usage": f"pyterrier-prob [{{{','.join(PAPERS)}}}] [options]",
            "description": f"commands ('pyterrier-prob <command> --help' for each one's options):\n{listing}\n\n"
            f"Without a command, 'pyterrier-prob [options]' runs {paper}, with these options.",
        }
    else:
        kwargs = {
            "prog": f"pyterrier-prob {paper}",
            "description": mod.DESCRIPTION,
            "epilog": f"Experiments: {', '.join(PAPERS)} (plain 'pyterrier-prob' runs '{DEFAULT}'; "
            "'pyterrier-prob --help' lists them).",
        }
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, **kwargs)
    ap.add_argument("--version", action="version", version=f"pyterrier-prob {__version__}")
    mod.add_arguments(ap)
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="also show the libraries' own output: ir_datasets' INFO lines, sentence-transformers' inner bars "
        "(Batches, Computing widget examples), Hugging Face's loading bars and torch's pin_memory warning",
    )
    return ap


def passive_waiting(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Let OpenMP's idle threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``) in a command's process, where
    neither ``OMP_WAIT_POLICY`` nor ``GOMP_SPINCOUNT`` is set and torch (whose OpenMP library reads it once, when it
    loads) is not yet imported. Spinning threads of two jobs on the same cores keep each other from running: measured
    on 2 cores, two partial-recipe trainings beside each other ran 3x faster with it (``docs/cluster.md``). Returns
    whether it was set."""
    if "torch" in sys.modules or any(environ.get(v) for v in OMP_WAIT_VARIABLES):
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def main(argv: list[str] | None = None) -> int:
    """Run ``pyterrier-prob [paper] [options]``; the exit status (2 for a bad setting or input, with a message)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:  # answered before a parser imports an experiment (torch, the models)
        print(f"pyterrier-prob {__version__}")
        return 0
    command = shlex.join(["pyterrier-prob", *argv])
    passive_waiting()  # before a parser imports an experiment, and with it torch
    named = bool(argv) and argv[0] in PAPERS
    paper = argv.pop(0) if named else DEFAULT
    a = build_parser(paper, commands=not named).parse_args(argv)
    setup_console(verbose=a.verbose)  # our bars and the table only, unless --verbose
    mod = importlib.import_module(PAPERS[paper])
    threads = importlib.import_module("st_extensions.threads")  # torch: only once a command runs
    try:
        cfg = mod.config_from_args(a)
        cfg.command = command
        cfg.check()
        threads.batch_scheduling(cfg.sched_slice_ms)  # the command's process only: a notebook's run leaves its own
        mod.run(cfg)
    except (ValueError, FileNotFoundError) as e:  # bad settings, collections, splits, models: a message, no traceback
        print(f"pyterrier-prob {paper}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
