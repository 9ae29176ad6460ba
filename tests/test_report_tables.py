"""The report's cheap table helpers: missing cells and a results file's table printed from its JSON."""

from __future__ import annotations

import json
import math

from pyterrier_prob.experiments.report import MISSING, cell, print_json_table


def test_cell_marks_every_kind_of_missing_value() -> None:
    assert [cell(v, ".2f") for v in (None, math.nan, math.inf, -math.inf)] == [MISSING] * 4
    assert cell(0.12345, ".3f") == "0.123"


def test_print_json_table_prints_what_render_makes_of_the_file(tmp_path, capsys) -> None:
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"rows": [{"name": "a", "value": 0.5}, {"name": "b", "value": None}]}))

    def render(result: dict) -> list[str]:
        return [f"| {r['name']} | {cell(r['value'], '.2f')} |" for r in result["rows"]]

    print_json_table(str(path), render)
    assert capsys.readouterr().out == f"| a | 0.50 |\n| b | {MISSING} |\n"
