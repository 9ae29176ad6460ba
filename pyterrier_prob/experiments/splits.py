"""An experiment's collections, splits and calibration/test queries (:func:`load_data`, the harness's
:meth:`~pyterrier_prob.experiments.harness.Harness.load_data`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from pyterrier_prob.collections import (
    Collection,
    HeldOutCollection,
    choose_splits,
    load_collection,
    source_splits,
    split_topics,
)

if TYPE_CHECKING:
    from pyterrier_prob.experiments.options import CommonConfig

__all__ = ["Data", "load_data"]


@dataclass
class Data:
    """The collections and query sets of one experiment (``train`` None: nothing to fine-tune on); ``cal_topics`` and
    ``cal_qrels``: the dev split, train queries held out (a ``HeldOutCollection``) or a seeded half of the test
    queries; ``notes`` says which, for the report."""

    train_collection: Collection
    test_collection: Collection
    train: str | None
    dev: str | None
    test: str
    cal_topics: pd.DataFrame
    cal_qrels: pd.DataFrame
    test_topics: pd.DataFrame
    test_qrels: pd.DataFrame
    cal_source: str
    notes: list[str] = field(default_factory=list)
    held_out: dict[str, Any] = field(default_factory=dict)  # the train queries held out as dev: split, share, seed

    def describe(self) -> dict[str, Any]:
        train = f"{self.train_collection.name}/{self.train}" if self.train else None
        names = {"train": train, "calibration": self.cal_source, "test": f"{self.test_collection.name}/{self.test}"}
        counts = {"n_calibration_queries": len(self.cal_topics), "n_test_queries": len(self.test_topics)}
        return {**names, **counts, "notes": list(self.notes)}


def load_data(cfg: CommonConfig, calibrate: bool = True, for_training: bool = False) -> Data:
    """Load ``--dataset`` (and ``--test-dataset``), choose the splits and the calibration/test queries (with
    ``calibrate`` and no dev split: ``--dev-from-train`` of the train queries, else a seeded half of test;
    ``for_training``: the dev queries serve training only, so none is held back from test when nothing trains)."""
    train_coll = test_coll = load_collection(cfg.dataset)
    notes: list[str] = []
    held_out: dict[str, Any] = {}
    if cfg.test_dataset:
        test_coll = load_collection(cfg.test_dataset)
        train, dev = source_splits(train_coll, cfg.train_split, cfg.dev_split)
        test = choose_splits(test_coll, None, None, cfg.test_split).test
        if cfg.steps:
            trained = f"/{train}" if train else " (no train split)"
            notes.append(
                f"zero-shot transfer: trained on {train_coll.name}{trained}, evaluated on {test_coll.name}/{test}"
            )
    else:
        ch = choose_splits(train_coll, cfg.train_split, cfg.dev_split, cfg.test_split)
        train, dev, test = ch.train, ch.dev, ch.test
    if calibrate and dev is None and train is not None and cfg.dev_from_train > 0:
        try:
            held = HeldOutCollection(train_coll, train, fraction=cfg.dev_from_train, seed=cfg.seed)
        except ValueError as e:
            raise ValueError(f"--dev-from-train {cfg.dev_from_train}: {e} (0: calibrate on half of test)") from e
        n_dev, n_fit = len(held.topics(held.dev_split)), len(held.topics(held.fit_split))
        notes.append(
            f"{train_coll.name} has no dev split: {n_dev} of its {train} queries ({cfg.dev_from_train:.0%}, "
            f"seed {cfg.seed}) are held out as {held.dev_split} for calibration"
            + (f"; training uses the other {n_fit} ({held.fit_split})" if cfg.steps else "")
        )
        held_out = {"split": train, "fraction": cfg.dev_from_train, "seed": cfg.seed}
        test_coll = held if test_coll is train_coll else test_coll
        train_coll, train, dev = held, held.fit_split, held.dev_split
    if cfg.steps == 0:
        if cfg.test_dataset:
            notes.append(f"zero-shot: evaluated on {test_coll.name}/{test}")
        notes.append(f"--steps 0: {cfg.model or 'the base model'} evaluated without fine-tuning")
        train = None
    elif train is None:
        notes.append(
            f"{train_coll.name} has no train split: {cfg.model or 'the base model'} is evaluated without fine-tuning"
        )
    calibrate = calibrate and not (for_training and train is None)
    test_topics, test_qrels = test_coll.topics(test), test_coll.qrels(test)
    if dev is not None:
        cal_topics, cal_qrels = train_coll.topics(dev), train_coll.qrels(dev)
        cal_source = f"{train_coll.name}/{dev}"
    elif not calibrate:
        cal_topics, cal_qrels = test_topics.iloc[:0], test_qrels.iloc[:0]
        cal_source = "none (nothing calibrated)"
    else:
        cal_topics, test_topics = split_topics(test_topics, seed=cfg.seed)
        cal_qrels = test_qrels[test_qrels["qid"].isin(set(cal_topics["qid"]))]
        test_qrels = test_qrels[test_qrels["qid"].isin(set(test_topics["qid"]))]
        cal_source = f"a seeded half (seed {cfg.seed}) of {test_coll.name}/{test}: {len(cal_topics)} queries"
        notes.append(
            f"no dev split: calibration on a seeded half of {test_coll.name}/{test} ({len(cal_topics)} "
            f"queries), results reported on the other, disjoint half ({len(test_topics)} queries)"
        )
    cal_qrels, test_qrels = cal_qrels.reset_index(drop=True), test_qrels.reset_index(drop=True)
    queries = (cal_topics, cal_qrels, test_topics, test_qrels, cal_source)
    return Data(train_coll, test_coll, train, dev, test, *queries, notes, held_out)
