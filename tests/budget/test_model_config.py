"""config.json from disk is untrusted: every hostile shape is one ConfigError line, in every command."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from kvguard.budget.estimator import ConfigError, kv_layout_from_config
from kvguard.budget.model_config import bundled_model_config_path, load_model_config
from kvguard.cli import main


def bundled() -> dict:
    with open(bundled_model_config_path()) as handle:
        return json.load(handle)


def write_text(tmp_path, text: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(text)
    return str(path)


HOSTILE = {
    "deep": ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests deeper than 64 levels"),
    "head_size_zero": (json.dumps({**bundled(), "hidden_size": 1}), "the head size would be 0"),
    "layers_10e400": (json.dumps(bundled())[:-1] + ', "num_hidden_layers": 1' + "0" * 400 + "}", "more than 19 digits"),
    "layers_huge": (json.dumps({**bundled(), "num_hidden_layers": 10**15}), "is larger than"),
    "nested_heads_zero": (
        json.dumps({**bundled(), "text_config": {"num_attention_heads": 0}}),
        "text_config.'num_attention_heads' must be a positive integer, got 0",
    ),
    "nan": (json.dumps(bundled())[:-1] + ', "hidden_size": NaN}', "NaN is not a number JSON allows"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_config_is_a_config_error(tmp_path, case):
    text, message = HOSTILE[case]
    with pytest.raises(ConfigError, match=None) as raised:
        load_model_config(write_text(tmp_path, text))
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_budget_and_simulate_give_one_line_for_a_hostile_config(tmp_path, case):
    path = write_text(tmp_path, HOSTILE[case][0])
    for command in (["budget", "--model-config", path], ["simulate", "--model-config", path, "--requests", "1"]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 65, (command, result.output)  # bad input
        assert result.output.startswith("Error: ") and len(result.output.strip().splitlines()) == 1
        assert result.exception is None or isinstance(result.exception, SystemExit)


def test_the_bundled_config_still_loads_and_lays_out(tmp_path):
    layout = kv_layout_from_config(load_model_config(bundled_model_config_path()))
    assert (layout.num_layers, layout.num_kv_heads, layout.head_size) == (28, 4, 128)


def test_a_model_directory_is_read_through_its_config_json(tmp_path):
    os.makedirs(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text(json.dumps(bundled()))
    assert load_model_config(str(tmp_path / "model"))["num_hidden_layers"] == 28
