"""Save a split cross-encoder student at its start, from a teacher bi-encoder folder: what ``pyterrier-prob varce``
keeps when no dev point beats step 0 (its plain run kept both students there), without the run's training and test
scoring. With ``--bi-encoder-path`` (the default, as the students) the score is the teacher's ``scale * cos`` plus a
joint term at weight 0; a VarCE variant adds its (untrained) std[s].

    python benchmarks/split_student.py --teacher outputs/v52/models/distill-teacher --variant VAR \\
        --output outputs/depth-reranker
"""

from __future__ import annotations

import argparse
import json
import os

from st_extensions.cross_encoder.split import build_split_cross_encoder


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", required=True, help="the teacher bi-encoder's folder")
    ap.add_argument("--output", required=True, help="where the student is saved (must not exist)")
    ap.add_argument("--variant", choices=["CE", "VAR", "MEANVAR"], default="VAR")
    ap.add_argument("--joint-layers", type=int, default=1)
    ap.add_argument("--max-seq-length", type=int, default=128)
    ap.add_argument("--no-bi-encoder-path", dest="bi_encoder_path", action="store_false")
    args = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(args.teacher, "modules.json")):
        raise SystemExit(f"--teacher {args.teacher!r} is not a saved sentence-transformers folder")
    if os.path.exists(args.output):
        raise SystemExit(f"--output {args.output!r} exists: choose a new folder")
    model = build_split_cross_encoder(
        args.teacher,
        joint_layers=args.joint_layers,
        bi_encoder_path=args.bi_encoder_path,
        variant=None if args.variant == "CE" else args.variant,
        max_seq_length=args.max_seq_length,
    )
    model.save_pretrained(args.output)
    with open(os.path.join(args.output, "split_student.json"), "w", encoding="utf8") as f:
        json.dump({"command": "python benchmarks/split_student.py", **vars(args), "trained_steps": 0}, f, indent=1)
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()
