"""The one JSON number encoder and its decoder (diag/foundations/jsonnum.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from diag.foundations.jsonnum import json_number, json_numbers, number_from_json


def test_non_finite_floats_are_the_strings_every_diag_file_uses() -> None:
    assert [json_number(v) for v in (math.inf, -math.inf, math.nan)] == ["inf", "-inf", "nan"]
    assert json_number(None) is None and json_number(7) == 7


def test_diag_json_rounds_to_6_digits_and_state_files_keep_the_exact_float() -> None:
    x = 0.1234567891234
    assert json_number(x) == 0.123457
    assert json_number(x, digits=None) == x
    assert json.dumps(json_number(np.float32(0.1), digits=None)) == "0.10000000149011612"


def test_exclusion_json_writes_nan_as_null() -> None:
    assert json_number(math.nan, digits=None, nan=None) is None
    tree = {"a": [math.nan, -math.inf, 1], "b": "x"}
    assert json_numbers(tree, digits=None, nan=None) == {"a": [None, "-inf", 1], "b": "x"}


def test_decoder_reads_back_what_the_encoder_wrote() -> None:
    for x in (0.5, math.inf, -math.inf):
        assert number_from_json(json_number(x)) == x
        assert number_from_json(json_number(x), strict=True) == x
    assert math.isnan(number_from_json("nan", strict=True))
    assert math.isnan(number_from_json(None))


@pytest.mark.parametrize("bad", [None, "Infinity", "1e3", True, [1.0]])
def test_strict_decoder_refuses_what_diag_never_writes(bad: object) -> None:
    with pytest.raises(ValueError):
        number_from_json(bad, strict=True)
