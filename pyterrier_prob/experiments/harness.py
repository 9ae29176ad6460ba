"""The shared experiment harness (:class:`Harness`): data, training with ``--reuse``/``--resume``, indexes, BM25,
``pt.Experiment`` with paired t-tests and the report that every paper's experiment uses. The options live in
:mod:`~pyterrier_prob.experiments.options`, the report's pieces in :mod:`~pyterrier_prob.experiments.report`, the output
folder's lock in :mod:`~pyterrier_prob.experiments.output`; their public names are importable from here too."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from functools import cached_property
from typing import Any

import ir_measures
import pandas as pd
import pyterrier as pt
import torch
from pyterrier_pisa import PisaIndex
from tqdm.auto import tqdm

from pyterrier_prob import console
from pyterrier_prob.atomic import atomic_directory, atomic_write, make_dirs
from pyterrier_prob.collections import Collection
from pyterrier_prob.console import native_output_to
from pyterrier_prob.curves import DevCurve, DevRetrieval, curve_summaries
from pyterrier_prob.data import judged_pairs, training_pairs
from pyterrier_prob.experiments.bm25 import OrderedBM25
from pyterrier_prob.experiments.options import CommonConfig, add_options, config_from_args, option, subcommand
from pyterrier_prob.experiments.output import LOCK_FILE, lock_output, read_if_present
from pyterrier_prob.experiments.report import (
    insert_columns,
    json_default,
    kept_untrained,
    loss_ends,
    markdown_table,
    measure_cell,
    model_figures,
    p_mark,
    report_head,
    slug,
)
from pyterrier_prob.experiments.splits import Data, load_data
from pyterrier_prob.index import DenseIndex, MoLIndex
from pyterrier_prob.training import Recipe, StepRate, fine_tune
from st_extensions import default_model_path, load_model
from st_extensions.cross_encoder.split import SplitTransformer
from st_extensions.frozen import CachedEmbeddings, build_adapter_model, cached_model, prefix_model
from st_extensions.model_card import save_with_card, set_card_figures
from st_extensions.partial import check_partial_transformer, state_fingerprint
from st_extensions.threads import configure_threads, is_batch_scheduled, thread_count

__all__ = [
    "LOCK_FILE",
    "CommonConfig",
    "Data",
    "Harness",
    "TrainingPairs",
    "add_options",
    "base_model",
    "config_from_args",
    "insert_columns",
    "lock_output",
    "loss_ends",
    "markdown_table",
    "measure_cell",
    "native_output_to",
    "option",
    "p_mark",
    "set_max_len",
    "slug",
    "subcommand",
]


def base_model(cfg: CommonConfig, adapter: bool = False) -> Any:
    """``--model`` (default: the packaged MiniLM) on the CPU; with ``adapter`` under a LinearAdapter (frozen recipe)."""
    model = load_model(cfg.model or default_model_path(), device="cpu")
    return build_adapter_model(model) if adapter else model


class TrainingPairs:
    """The train split's rows (:func:`~pyterrier_prob.data.training_pairs`) and judged pairs, made once per run."""

    def __init__(self, data: Data, seed: int) -> None:
        self.data, self.seed = data, seed

    def __call__(self) -> Any:
        return self.rows

    @cached_property
    def rows(self) -> Any:
        return training_pairs(self.data.train_collection, self.data.train, seed=self.seed)

    @cached_property
    def judged(self) -> Any:
        return judged_pairs(self.data.train_collection, self.data.train)

    def loss(self, model: Any, cls: type, **settings: Any) -> Any:
        """``cls(model, ...)`` masking the judged pairs as in-batch negatives (read only when a model trains)."""
        return cls(model, judged=self.judged, **settings)


_NO_DOCUMENT = "<no document retrieved>"  #: Harness.experiment's stand-in for an empty run


class Harness:
    """Stages, models, indexes, ``pt.Experiment`` and the report of one experiment run (module docstring)."""

    def __init__(self, name: str, cfg: CommonConfig) -> None:
        cfg.check()
        if cfg.resume:  # what finished is reused; what was cut off resumes from its checkpoints
            cfg.reuse = True
        self.name, self.cfg = name, cfg
        try:
            self.output = str(make_dirs(cfg.output))
        except OSError as e:
            raise ValueError(f"--output {cfg.output!r} cannot be created: {e.strerror or e}") from e
        if not os.access(self.output, os.W_OK | os.X_OK):
            raise ValueError(f"--output {cfg.output!r} is not writable")
        self._lock = lock_output(self.output)  # held until finish() (or the process ends)
        weakref.finalize(self, self._lock.close)
        self.threads = configure_threads(cfg.threads)
        self.batch_scheduled = is_batch_scheduled()  # set by the command line (cli.main), never by a notebook run
        self.verbose = not cfg.quiet
        self.timings: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self._fresh: set[str] = set()  # models trained in this run: their indexes are rebuilt
        self._model_settings: dict[str, dict[str, Any]] = {}  # name -> what made the model (for index reuse)
        self._held_out: dict[str, Any] = {}  # the train queries held out as dev (load_data), part of a model's settings
        self._train_data: str | None = None  # "<collection>/<split>" the models train on (load_data; model cards)
        self._bm25: dict[str, Any] = {}  # collection name -> its PISA index, built once per run
        self._cache: Any = None  # the frozen recipe's encoder-output cache (st_extensions.frozen.CachedEmbeddings)
        self._cache_file = self.path("cache", "encoder.safetensors")
        self._base = {"model": cfg.model, "max_seq_length": cfg.max_seq_length}  # what makes the base encoder
        self.recipes: dict[str, dict[str, Any]] = {}  # model name -> the recipe it trained under (summary.json)
        self.step_rates: dict[str, float | None] = {}  # model name -> its training's steps/s (summary.json)
        self.dev_measures: dict[str, str] = {}  # model name -> its dev curve's measure (summary.json's dev_curves)
        self._dev_pool: Any = None  # (dev topics, docno -> text) every system's dev measure searches
        self.saved_models: dict[str, str] = {}  # model name -> its folder: finish() adds the figures to its card
        self.records: dict[str, dict[str, Any]] = {}  # model name -> its loss's record(), saved beside the model
        self.rows_info: dict[str, Any] = {}  # model name -> its training rows' ``info`` (when they had one), saved too
        self.recipe = cfg.training_recipe(max(cfg.steps, 1))  # the run's recipe (what its options choose)
        if not console.verbose():  # the libraries' own bars and INFO lines are not stages (unless --verbose)
            console.quiet_libraries()

    # ---- stages and progress ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, name: str, message: str) -> Iterator[None]:
        """Time a stage (``summary.json``'s ``timings_s``) and announce it with one line."""
        start = time.perf_counter()
        if self.verbose:
            print(f"[{start - self.t0:7.1f}s] {message}", flush=True)
        try:
            yield
        finally:
            self.timings[name] = round(self.timings.get(name, 0.0) + time.perf_counter() - start, 2)

    def progress(self, iterable: Iterable[Any], desc: str, total: int | None = None, unit: str = "it") -> Iterable[Any]:
        """A tqdm bar over ``iterable`` (none when quiet)."""
        return tqdm(iterable, desc=desc, total=total, unit=unit, disable=not self.verbose, dynamic_ncols=True)

    def path(self, *parts: str) -> str:
        return os.path.join(self.output, *parts)

    # ---- collections ------------------------------------------------------------------------------------------
    def load_data(self, calibrate: bool = True, for_training: bool = False) -> Data:
        """Load the collections, splits and calibration/test queries (``calibrate``: whether the run needs them;
        ``for_training``: only to train, so none is held back from test when nothing trains)."""
        cfg = self.cfg
        with self.stage("load", f"loading {cfg.dataset}" + (f" and {cfg.test_dataset}" if cfg.test_dataset else "")):
            data = load_data(cfg, calibrate, for_training)
        self._held_out = data.held_out
        self._train_data = data.describe()["train"]
        return data

    # ---- models -----------------------------------------------------------------------------------------------
    def train(
        self,
        name: str,
        build: Callable[[], Any],
        loss: Callable[[Any], Any],
        data: Callable[[], Any] | None,
        *,
        settings: Mapping[str, Any] | None = None,
        encoder_cache: Any = None,
        callbacks: Sequence[Any] = (),
        dev: Callable[[Any], float] | None = None,
        **recipe_fields: Any,
    ) -> tuple[Any, list[float]]:
        """Build, fine-tune under the run's recipe (``recipe_fields`` replaced) and save a model as
        ``output/models/<name>``; returns ``(model, losses)``. ``data`` builds the rows (None, or ``steps`` 0: the
        built model, untrained); ``--reuse`` loads a saved model made with the same ``settings``. ``dev``
        (:meth:`dev_evaluator`) runs every ``--dev-every`` steps and the best dev step's weights are kept."""
        overrides = {k: dict(v) if isinstance(v, Mapping) else v for k, v in recipe_fields.items() if v is not None}
        steps = overrides.pop("steps", self.cfg.steps)
        recipe = self.cfg.training_recipe(steps, **overrides) if data is not None and steps else None
        every = self.cfg.dev_every or (250 if self.recipe.trains_encoder else None)
        if recipe is not None and dev is not None and every:  # the dev choice of the step is part of the model
            settings = {**(settings or {}), "dev": {"every": every, "patience": self.cfg.patience}}
            curve = DevCurve(every, dev, self.path("curves", f"{name}.json"), patience=self.cfg.patience)
            callbacks, self.dev_measures[name] = [*callbacks, curve], str(getattr(dev, "measure", "dev"))
        wanted = self._train_settings(name, recipe, settings)
        if recipe is None:
            return set_max_len(build(), self.cfg.max_seq_length), []
        self.recipes[name] = recipe.to_dict()
        if (reused := self._reused_model(name, wanted)) is not None:
            return reused
        with self.stage(f"train_{name}", f"fine-tuning {name}: {steps} steps of {recipe.batch_size} ({recipe.label})"):
            torch.manual_seed(self.cfg.seed)
            model = set_max_len(build(), self.cfg.max_seq_length)
            own_cache = recipe.caches_features and encoder_cache is None
            rows = data()  # before the loss: a loss may use what the rows' making found (e.g. the judged pairs)
            rate, training_loss = StepRate(), loss(model)
            resume = self._resumable(name, wanted) and self.cfg.resume  # (writes the settings in any case)
            run = {"output_dir": self.path("runs", name), "resume": resume, "show_progress": self.verbose}
            run["encoder_cache"] = self.encoder_cache(model) if own_cache else encoder_cache
            run["state_cache"] = self.state_cache_path(recipe, model) if recipe.caches_states else None
            losses = fine_tune(
                model, training_loss, rows, recipe, desc=f"training {name}", callbacks=[*callbacks, rate], **run
            )
            here = os.path.abspath(self.path("curves"))
            curves = [c.path for c in callbacks if isinstance(c, DevCurve) and c.path and os.path.isfile(c.path)]
            curves = [c for c in curves if os.path.dirname(os.path.abspath(c)) == here]  # the run's own curves
            self.step_rates[name] = rate.steps_per_second
            if own_cache:
                self.save_encoder_cache()
            self.rows_info[name] = getattr(data, "info", None)  # what the rows' making reported (e.g. varce's)
            info = {
                "settings": wanted,
                "losses": losses,
                "rows": self.rows_info[name],
                "steps_per_s": rate.steps_per_second,
                # the dev curves as they led to these weights: a later training of the same name that is killed
                # rewrites curves/, and --reuse of this model puts its own curves back (_reused_model)
                "dev_curves": {os.path.relpath(c, self.output): read_if_present(c) for c in curves},
            }
            self._save_trained(name, model, recipe, info, training_loss, rows)
        self._fresh.add(name)
        return model, losses

    def dev_evaluator(
        self, data: Data, measure: str = "nDCG@10", score: Callable[..., Any] | None = None, queries: int = 200
    ) -> DevRetrieval | None:
        """:meth:`train`'s ``dev``: ``measure`` of exact search (``score``: :class:`DevRetrieval`) over the union of
        BM25's top 100 of ``queries`` seeded dev queries (pool built once per run); None: no dev curves."""
        if not (self.cfg.dev_every or self.recipe.trains_encoder):
            return None
        if self._dev_pool is None:
            topics = data.cal_topics.astype({"qid": str})
            topics = topics.sample(n=min(queries, len(topics)), random_state=self.cfg.seed).sort_values("qid")
            if topics.empty:
                raise ValueError("--dev-every needs calibration/dev queries, this run has none")
            coll = data.train_collection if data.dev else data.test_collection  # where the dev queries come from
            wanted = set(self.bm25_run(self.bm25(coll), topics, 100)["docno"].astype(str))
            self._dev_pool = topics, {d["docno"]: d["text"] for d in coll.corpus_iter() if d["docno"] in wanted}
        return DevRetrieval(self._dev_pool[0], data.cal_qrels, self._dev_pool[1], measure, score)

    def _train_settings(self, name: str, recipe: Recipe | None, settings: Mapping[str, Any] | None) -> dict[str, Any]:
        """What makes the model ``name``: compared by ``--reuse`` with a saved model's and with its indexes'."""
        if recipe is None:
            wanted = {**self._base, "trained": False}
        else:
            recipe_settings = {k: v for k, v in recipe.to_dict().items() if not k.startswith("checkpoint_")}
            wanted = {**self._base, "dataset": self.cfg.dataset, "recipe": recipe_settings}
            wanted |= {"held_out_dev": self._held_out} if self._held_out else {}
        self._model_settings[name] = json.loads(json.dumps({**wanted, **(settings or {})}, default=str))
        return self._model_settings[name]

    def _resumable(self, name: str, wanted: dict[str, Any]) -> bool:
        """Whether ``--resume`` may continue ``runs/<name>``'s checkpoints: they were made with the ``wanted`` settings
        (``runs/<name>/settings.json``, written here; a folder without one is trusted as before). Checkpoints of other
        settings (another head, rows or teacher under the same recipe) are dropped and the model trains afresh."""
        run_dir = self.path("runs", name)
        saved = read_if_present(os.path.join(run_dir, "settings.json"))
        if saved is not None and saved != wanted and self.verbose:
            changed = sorted(k for k in {*saved, *wanted} if saved.get(k) != wanted.get(k))
            print(f"{name}: its checkpoints were made with other settings ({', '.join(changed)}): training afresh")
        make_dirs(run_dir)
        atomic_write(os.path.join(run_dir, "settings.json"), json.dumps(wanted, indent=1))
        return saved is None or saved == wanted

    def _reused_model(self, name: str, wanted: dict[str, Any]) -> tuple[Any, list[float]] | None:
        """With ``--reuse``: the saved model ``name`` and its losses when it was made with the ``wanted`` settings."""
        path = self.path("models", name)
        saved = read_if_present(os.path.join(path, "train_settings.json")) if self.cfg.reuse else None
        if not isinstance(saved, dict) or saved.get("settings") != wanted:
            return None
        with self.stage(f"load_{name}", f"reusing the {name} model in {path}"):
            model = set_max_len(load_model(path, device="cpu"), self.cfg.max_seq_length)
        self.saved_models[name], self.records[name] = path, dict(saved.get("record") or {})
        self.rows_info[name] = saved.get("rows")
        for rel, curve in (saved.get("dev_curves") or {}).items():  # the curves that led to these weights
            curve_path = self.path(rel)
            if read_if_present(curve_path) != curve:  # e.g. a retrain of this name, killed, began another
                atomic_write(curve_path, json.dumps(curve, indent=1))
        if saved.get("steps_per_s") is not None:  # its training's speed, as the run that trained it measured
            self.step_rates[name] = saved["steps_per_s"]
        return model, list(saved.get("losses", []))

    def _save_trained(
        self, name: str, model: Any, recipe: Recipe, info: dict[str, Any], loss: Any = None, rows: Any = None
    ) -> None:
        """Save a trained model with its recipe, ``info``, its loss's ``record()`` and card; drop its checkpoints."""
        path = self.path("models", name)
        self.records[name] = dict(loss.record()) if callable(getattr(loss, "record", None)) else {}
        info = {**info, "record": self.records[name]}
        train_data = self._train_data or self.cfg.dataset
        save_with_card(
            path, model, loss=loss, recipe=recipe.describe(), train_data=train_data, rows=rows, model_name=name
        )
        self.saved_models[name] = path
        recipe.save(os.path.join(path, "recipe.json"))
        atomic_write(os.path.join(path, "train_settings.json"), json.dumps(info, indent=1))
        shutil.rmtree(self.path("runs", name), ignore_errors=True)  # the saved model replaces the checkpoints

    def state_cache_path(self, recipe: Any, model: Any = None) -> str:
        """The partial recipe's folder of lower-layer states, one per ``model``'s ``state_fingerprint``."""
        base = slug(os.path.basename(str(self.cfg.model or "minilm").rstrip("/"))) or "model"
        name = f"states-{base}-{self.cfg.max_seq_length}-top{recipe.train_layers}"
        first = next(iter(model), None) if model is not None else None
        if first is not None and not isinstance(first, SplitTransformer):  # a split cross-encoder: its own cache
            frozen = len(check_partial_transformer(first).encoder.layer) - recipe.train_layers
            name += f"-{state_fingerprint(first, frozen)[:12]}"
        return self.path("cache", name)

    # ---- the frozen recipe's encoder cache ---------------------------------------------------------------------
    def encoder_cache(self, model: Any) -> Any:
        """The run's cache of base-encoder outputs, shared by every system; kept in ``output/cache/`` for later runs."""
        if self._cache is None:
            path = self._cache_file
            if read_if_present(f"{path}.settings.json") == self._base and os.path.isfile(path):
                self._cache = CachedEmbeddings.load_cache(path)
            else:
                self._cache = CachedEmbeddings([], torch.zeros(0, model.get_embedding_dimension()))
        if self._cache.encoder[0] is None:
            self._cache.encoder[0] = prefix_model(model, require_added=False)
        return self._cache

    def save_encoder_cache(self) -> None:
        """Write the encoder cache (atomically) so a later or resumed run does not encode the texts again."""
        if self._cache is None:
            return
        make_dirs(os.path.dirname(self._cache_file))
        self._cache.save_cache(self._cache_file)
        atomic_write(f"{self._cache_file}.settings.json", json.dumps(self._base))

    def encoding_model(self, model: Any) -> Any:
        """Under the frozen recipe ``model``'s added modules on the run's encoder cache, else ``model``."""
        return cached_model(model, cache=self.encoder_cache(model)) if self.recipe.caches_features else model

    # ---- indexes ----------------------------------------------------------------------------------------------
    def _index_path(self, name: str, collection: Collection, ext: str) -> str:
        return self.path("indexes", f"{name}-{slug(collection.name)}.{ext}")

    def _reusable(self, name: str, path: str) -> bool:
        """With ``--reuse``: the index exists and was built by a model made with the same settings."""
        if not self.cfg.reuse or name in self._fresh or not os.path.isfile(os.path.join(path, "pt_meta.json")):
            return False
        return read_if_present(f"{path}.settings.json") == self._index_settings(name)

    def _index_settings(self, name: str) -> dict[str, Any]:
        return {"model": self._model_settings.get(name, self._base), "max_seq_length": self.cfg.max_seq_length}

    def dense_index(self, name: str, encoder: Any, collection: Collection) -> Any:
        """Encode ``collection`` with a pyterrier-dr BiEncoder into a :class:`~pyterrier_prob.DenseIndex` (``name``: the
        model's name in :meth:`train`; ``--reuse`` reuses an index built by a model made with the same settings)."""
        return self._index(name, DenseIndex, "flex", encoder.doc_encoder(verbose=False), collection)

    def mol_index(self, name: str, encoder: Any, collection: Collection) -> Any:
        """Encode ``collection`` with a MoLEncoder into a :class:`~pyterrier_prob.MoLIndex` (as :meth:`dense_index`)."""
        return self._index(name, MoLIndex, "mol", encoder.doc_encoder(), collection)

    def _index(self, name: str, cls: type, ext: str, doc_encoder: Any, collection: Collection) -> Any:
        path = self._index_path(name, collection, ext)
        index = cls(path, verbose=self.verbose)
        if self._reusable(name, path):
            return index
        with self.stage(f"index_{name}", f"encoding {collection.name} with {name} into {path}"):
            (doc_encoder >> index.indexer(mode="overwrite")).index(collection.corpus_iter())
        atomic_write(f"{path}.settings.json", json.dumps(self._index_settings(name), indent=1))
        if self.recipe.caches_features:  # the documents just encoded join the run's encoder cache on disk
            self.save_encoder_cache()
        return index

    def bm25(self, collection: Collection) -> Any:
        """A PISA index of ``collection`` for BM25, built once per run (``--reuse``: per output folder)."""
        if collection.name in self._bm25:
            return self._bm25[collection.name]
        path = self._index_path("bm25", collection, "pisa")
        make_dirs(os.path.dirname(path))
        index = PisaIndex(path, text_field="text", threads=thread_count(), overwrite=True)
        if not (self.cfg.reuse and index.built()):
            with self.stage("index_bm25", f"indexing {collection.name} with PISA for BM25 (log: {path}.log)"):
                with native_output_to(f"{path}.log", fds=(1, 2)), atomic_directory(path, overwrite=True) as tmp:
                    built = PisaIndex(str(tmp), text_field="text", threads=thread_count(), overwrite=True)
                    built.index(self.progress(collection.corpus_iter(), "indexing BM25", collection.num_docs, "doc"))
                    built.bm25(num_results=1)(pd.DataFrame({"qid": ["warm-up"], "query": ["warm up"]}))
        self._bm25[collection.name] = index
        return index

    def bm25_retriever(self, index: Any, k: int) -> Any:
        """PISA's BM25 top ``k`` as a PyTerrier transformer, its native log going to the index's log file and its rows
        in the queries' order, each query's by rank (:class:`~pyterrier_prob.experiments.bm25.OrderedBM25`)."""
        return OrderedBM25(index.bm25(num_results=k), f"{index.path}.log")

    def bm25_run(self, index: Any, topics: pd.DataFrame, k: int) -> pd.DataFrame:
        """BM25's top ``k`` for ``topics`` (``qid, docno, score, rank`` + query columns)."""
        return self.bm25_retriever(index, k)(topics)

    # ---- evaluation -------------------------------------------------------------------------------------------
    def experiment(
        self,
        runs: Mapping[str, pd.DataFrame],
        topics: pd.DataFrame,
        qrels: pd.DataFrame,
        measures: Sequence[Any],
        baseline: str | None = None,
        perquery: bool = False,
    ) -> pd.DataFrame:
        """``pt.Experiment`` over precomputed runs: ``name``, one column per measure and, with a ``baseline`` (its
        name), paired t-tests' ``<measure> p-value`` columns; with ``perquery`` the per-query frame instead."""
        names = list(runs)
        ms = [ir_measures.parse_measure(m) if isinstance(m, str) else m for m in measures]
        frames = [r[["qid", "docno", "score"]].assign(qid=r["qid"].astype(str)) for r in runs.values()]
        # pt.Experiment refuses a run without a row (a variable-depth rule may keep nothing for every query): one
        # document no qrels judge, for one query, scores 0 in every measure as an empty run does
        empty = pd.DataFrame({"qid": [str(q) for q in topics["qid"].iloc[:1]], "docno": [_NO_DOCUMENT], "score": 0.0})
        frames = [f if len(f) else empty for f in frames]
        base = names.index(baseline) if baseline is not None and not perquery else None
        return pt.Experiment(frames, topics, qrels, eval_metrics=ms, names=names, perquery=perquery, baseline=base)

    # ---- report -----------------------------------------------------------------------------------------------
    def finish(
        self, title: str, markdown: str, tables: Mapping[str, pd.DataFrame], summary: Mapping, data: Data | None = None
    ) -> dict[str, Any]:
        """Write ``results.md``, ``<table>.csv`` per table and ``summary.json`` and print the report (also when
        ``quiet``); returns the summary as written (with ``timings_s``, ``total_s`` and ``outputs``)."""
        total = round(time.perf_counter() - self.t0, 1)
        # the curves of the models trained here through ``train(dev=...)``, and those the experiment passes
        curves = curve_summaries(self.path("curves"), self.dev_measures, self.recipes) | dict(
            summary.get("dev_curves") or {}
        )
        head = report_head(title, data, self.recipes)
        if untrained := kept_untrained(curves):
            head += [
                f"Kept untrained: no dev point after step 0 beat the start for {', '.join(untrained)}, so the weights "
                "kept (those of the best dev point) are the untrained ones.",
                "",
            ]
        text = "\n".join(head) + "\n" + markdown.strip() + f"\n\nWall time: {total:.0f} s.\n"
        outputs = {name: atomic_write(self.path(f"{name}.csv"), f.to_csv(index=False)) for name, f in tables.items()}
        outputs["results.md"] = atomic_write(self.path("results.md"), text)
        if self.recipes:  # the recipe every model of this run trained under
            outputs["recipes.json"] = atomic_write(self.path("recipes.json"), json.dumps(self.recipes, indent=1))
        for name, folder in self.saved_models.items():  # each saved model's card gets the figures this run measured
            set_card_figures(folder, f"{self.name}: {title}", model_figures(name, tables))
        omp_wait = os.environ.get("OMP_WAIT_POLICY")  # how OpenMP's idle threads wait (cli.passive_waiting)
        full = {
            "experiment": self.name,
            "config": asdict(self.cfg),
            "data": data.describe() if data is not None else None,
            "recipes": dict(self.recipes),
            **dict(summary),
            "timings_s": dict(self.timings),
            "train_steps_per_s": dict(self.step_rates),
            "cpu": {"threads": self.threads, "batch_scheduled": self.batch_scheduled, "omp_wait_policy": omp_wait},
            "dev_curves": curves,
            "kept_untrained": untrained,
            "total_s": total,
            "tables": {name: f.to_dict(orient="records") for name, f in tables.items()},  # the report's figures
        }
        full["outputs"] = {**outputs, "summary.json": self.path("summary.json")}
        atomic_write(self.path("summary.json"), json.dumps(full, indent=2, default=json_default))
        if copy := self.cfg.results_json:  # the summary where the docs' tables can name it, with its command line
            if os.path.isdir(copy) or copy.endswith(os.sep):
                copy = os.path.join(make_dirs(copy), f"{self.name}.json")
            copied = {"command": self.cfg.command, **full}
            full["outputs"]["results_json"] = atomic_write(copy, json.dumps(copied, indent=2, default=json_default))
        if isinstance(getattr(self.cfg, "timings", None), dict):  # a config with a timings field gets the stages'
            self.cfg.timings.update(self.timings)
        print("\n" + text, flush=True)
        print(f"results written to {self.path('results.md')} (tables as CSV, summary.json) in {self.output}/")
        self._lock.close()  # the folder is complete: another run may take it
        return full


def set_max_len(model: Any, n: int) -> Any:
    """Set the model's token budget (``ValueError`` beyond its ``max_position_embeddings``) and return the model."""
    for m in model.modules() if isinstance(model, torch.nn.Module) else []:
        limit = getattr(getattr(m, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and limit > 0:
            if n > limit:
                raise ValueError(f"--max-seq-length {n} exceeds the model's position limit of {limit} tokens")
            break
    if hasattr(model, "max_seq_length"):
        model.max_seq_length = n
    elif hasattr(model, "max_length"):
        model.max_length = n
    return model
