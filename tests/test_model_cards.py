"""Model cards (issue 33, "Sharing"): every model a run saves has a README.md naming its loss, recipe and training
data, and, once the run has finished, the figures it measured."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pandas as pd

from pyterrier_prob.experiments.harness import CommonConfig, Harness, TrainingPairs
from st_extensions import build_pebr_model, load_model
from st_extensions.losses import BetaNCELoss
from st_extensions.model_card import CARD, set_card_figures, write_model_card


def _pebr(base_model):
    return build_pebr_model(base_model, family="beta", projection=True)


def test_a_trained_model_has_a_card_with_loss_recipe_data_and_the_runs_figures(base_model, small_beir, tmp_path):
    cfg = CommonConfig(dataset=str(small_beir[0]), output=str(tmp_path / "o"), steps=2, batch_size=4, quiet=True)
    h = Harness("pebr", cfg)
    data = h.load_data()
    pairs = TrainingPairs(data, cfg.seed)
    model, losses = h.train("pebr", partial(_pebr, base_model), lambda m: BetaNCELoss(m, judged=pairs.judged), pairs)
    assert len(losses) == 2
    folder = tmp_path / "o" / "models" / "pebr"
    card = (folder / CARD).read_text()
    assert card.startswith("---\n") and "library_name: sentence-transformers" in card  # sentence-transformers' card
    assert "license: apache-2.0" in card and "- pyterrier-prob" in card and "- QueryDistributionHead" in card
    assert "st_extensions.losses.pebr.BetaNCELoss" in card or "st_extensions.losses.BetaNCELoss" in card
    assert "**frozen** -- only the added modules train" in card and "2 steps of 4" in card  # Recipe.describe()
    assert f"**Training data:** {data.describe()['train']} (" in card
    assert "`st_extensions.modules" in card and "pickled weights are refused" in card
    assert "Measured figures" not in card

    results = pd.DataFrame({"name": ["untrained", "pEBR (CDF cutoff)"], "nDCG@10": [0.25, 0.5]})
    h.finish("pEBR test", "a table", {"results": results}, {})
    card = (folder / CARD).read_text()
    assert "### Measured figures (pebr: pEBR test)" in card
    assert "| pEBR (CDF cutoff) | 0.5000 |" in card and "untrained" not in card.split("Measured figures")[1]
    assert load_model(str(folder)) is not None  # the card does not disturb loading

    # a second run's figures replace the first's
    assert set_card_figures(folder, "again", "| x |") == str(folder / CARD)
    card = (folder / CARD).read_text()
    assert card.count("### Measured figures") == 1 and card.rstrip().endswith("| x |")
    assert set_card_figures(tmp_path / "nothing", "t", "x") is None


def test_cross_encoder_cards(tmp_path, minilm_path):
    """A VarCE's and a split (distilled) student's cards: sentence-transformers' CrossEncoder card and ours."""
    from sentence_transformers.cross_encoder.losses import MarginMSELoss

    from st_extensions import build_var_cross_encoder
    from st_extensions.cross_encoder.split import build_split_cross_encoder

    model = build_var_cross_encoder(minilm_path, variant="MEANVAR")
    model.save(str(tmp_path / "ce"))
    path = write_model_card(tmp_path / "ce", model, recipe="not trained here", train_data="toy/train", rows=3)
    card = Path(path).read_text(encoding="utf8")
    assert card.startswith("---\n") and "- pyterrier-prob" in card and "**Recipe:** not trained here" in card
    assert "**Training data:** toy/train (3 rows)" in card and "VariationalHead" in card

    split = build_split_cross_encoder(minilm_path)
    split.save(str(tmp_path / "split"))
    loss = MarginMSELoss(split)
    text = Path(write_model_card(tmp_path / "split", split, loss=loss, train_data="t/train", rows=6)).read_text()
    assert text.startswith("---\n") and "MarginMSELoss" in text and "**Recipe:** not fine-tuned" in text
