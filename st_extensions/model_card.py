"""Model cards: the ``README.md`` of a saved model, as sentence-transformers writes it (its ``model_card_data``) filled
with what training knows -- language, licence, name, training data, the loss, our module classes -- plus a section
of our own: the recipe it trained under, the training data and, once a run has measured them, its figures.
Every write is atomic (:func:`st_extensions.atomic.atomic_write`). See ``docs/sharing.md``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from sentence_transformers.base.model_card import generate_model_card, get_losses
from sentence_transformers.util import fullname

from st_extensions.atomic import atomic_directory, atomic_write

__all__ = ["CARD", "model_card_section", "save_with_card", "set_card_figures", "write_model_card"]

logger = logging.getLogger(__name__)

CARD = "README.md"
_FIGURES = "### Measured figures"
_SECTION = "## pyterrier-prob"
_LOAD = (
    "Load it with `pip install pyterrier-prob` and `st_extensions.load_model(folder)` (safetensors weights only: "
    "pickled weights are refused)."
)


def model_card_section(
    model: Any, loss: Any = None, recipe: str | None = None, train_data: str | None = None, rows: int | None = None
) -> str:
    """Our part of the card: the model's module classes, the ``loss``, the ``recipe`` (``Recipe.describe()``), the
    training data (``train_data``, e.g. ``"nfcorpus/train"``, with its number of ``rows``) and how to load it."""
    modules = [fullname(m) for m in model.children()] if hasattr(model, "children") else []
    lines = [_SECTION, "", f"- **Modules:** {', '.join(f'`{m}`' for m in modules) or 'none'}"]
    if loss is not None:
        lines.append(f"- **Loss:** {', '.join(f'`{fullname(part)}`' for part in get_losses(loss))}")
    lines.append(f"- **Recipe:** {recipe or 'not fine-tuned'}")
    lines.append(f"- **Training data:** {train_data or 'none'}{'' if rows is None else f' ({rows} rows)'}")
    return "\n".join([*lines, "", _LOAD, ""])


def write_model_card(
    folder: str | os.PathLike,
    model: Any,
    *,
    loss: Any = None,
    recipe: str | None = None,
    train_data: str | None = None,
    rows: int | None = None,
    columns: Sequence[str] = (),
    model_name: str | None = None,
    language: str = "en",
    license: str = "apache-2.0",
) -> str:
    """Write ``folder/README.md`` (atomically) for the saved ``model``: sentence-transformers' card from its
    ``model_card_data`` (``language``, ``license``, ``model_name``, the training data with its ``rows`` and
    ``columns``, the ``loss``; tags ``pyterrier-prob`` and our module classes), then :func:`model_card_section`.
    A card sentence-transformers cannot render is logged and replaced by our section alone. Returns the path."""
    folder = os.fspath(folder)
    card = getattr(model, "model_card_data", None)
    head = ""
    if card is not None:
        card.set_language(language)
        card.set_license(license)
        card.model_name = model_name or card.model_name
        ours = {type(m).__name__ for m in model.children() if type(m).__module__.startswith("st_extensions.")}
        card.add_tags(["pyterrier-prob", *ours])
        if loss is not None:
            card.set_losses(get_losses(loss))
        if train_data:
            about = {"name": train_data, "size": rows, "columns": list(columns)}
            card.train_datasets = [{**about, "loss": {"fullname": fullname(loss) if loss is not None else "none"}}]
        card.save_dir = folder
        try:
            head = generate_model_card(model).rstrip() + "\n\n"
        except Exception as e:  # the weights are saved; a card without sentence-transformers' part beats none
            logger.warning("sentence-transformers could not render the model card of %s: %s", folder, e)
    return atomic_write(os.path.join(folder, CARD), head + model_card_section(model, loss, recipe, train_data, rows))


def save_with_card(
    folder: str | os.PathLike, model: Any, *, loss: Any, recipe: str, train_data: str, rows: Any = None, model_name: str
) -> str:
    """Save ``model`` to ``folder`` atomically (a sibling folder renamed into place) with its card
    (:func:`write_model_card`; ``rows``: the training rows, counted and their columns named); returns ``folder``."""
    with atomic_directory(str(folder), overwrite=True) as tmp:
        model.save(str(tmp))
        n, columns = (None, ()) if rows is None else (len(rows), getattr(rows, "column_names", ()))
        write_model_card(
            tmp, model, loss=loss, recipe=recipe, train_data=train_data, rows=n, columns=columns, model_name=model_name
        )
    return str(folder)


def set_card_figures(folder: str | os.PathLike, title: str, markdown: str) -> str | None:
    """Put a run's measured figures (``markdown``, e.g. its result table rows for this model, under ``title``) into
    the card of the model in ``folder`` (replacing earlier figures; atomically). Returns the path, or None when the
    folder has no card."""
    path = os.path.join(os.fspath(folder), CARD)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf8") as f:
        text = f.read()
    text = re.split(rf"^{re.escape(_FIGURES)}", text, maxsplit=1, flags=re.M)[0].rstrip()
    return atomic_write(path, f"{text}\n\n{_FIGURES} ({title})\n\n{markdown.strip()}\n")
