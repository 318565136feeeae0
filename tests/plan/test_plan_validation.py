"""`kvguard plan` against the real logs that state weights or the activation peak (issue 20, deliverable 4).

For every log of the real-log corpus (tests/data/logs/real) that names its model, `kvguard plan
--json` runs with that model's config.json fields and the serve settings its release ran
(tests/data/plan_validation.json); the figures it is checked against are the logs' own (MANIFEST.json). Weights
must agree within 2%. The activation peak is a model: its error is measured, not asserted, and published per era
in exporter/kvguard/plan/accuracy.json, which plan's output cites; the table must match what the corpus gives
now (bench/plan_validation.py --write-accuracy rewrites it).

The KV budget (issue 33): on the logs held out by bench/plan_validation.py's HELD_OUT_RULE, plan never refuses a
command vLLM started, and each log's budget is within 10% of what it states or its miss is named term by term in
plan_validation.json 'kv_missed'."""

import importlib.util
import json
import os
import re

import pytest
from click.testing import CliRunner
from conftest import DATA, ROOT

from kvguard.cli import main
from kvguard.sim.workload import model_shape, weight_tensors

REPO = ROOT
VALIDATION = os.path.join(DATA, "plan_validation.json")
MANIFEST = os.path.join(DATA, "logs", "real", "MANIFEST.json")
ACCURACY = os.path.join(REPO, "exporter", "kvguard", "plan", "accuracy.json")
GIB = 1 << 30


def _bench():
    spec = importlib.util.spec_from_file_location(
        "plan_validation_bench", os.path.join(REPO, "bench", "plan_validation.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench()
CASES = BENCH.load_cases()


def read_json(path):
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """One `kvguard plan --json` per log, with its errors against the log's figures."""
    directory = str(tmp_path_factory.mktemp("configs"))
    return {case["id"]: BENCH.errors(case, BENCH.run_plan(case, directory)) for case in CASES}


# ----------------------------------------------------------------------------------------- the corpus


def test_every_log_that_states_weights_or_the_activation_peak_is_validated_or_says_why():
    data = read_json(VALIDATION)
    stating = {
        entry["id"]
        for entry in read_json(MANIFEST)["logs"]
        if entry["expect"].get("weights_gib") is not None or entry["expect"].get("peak_activation_gib") is not None
    }
    # The held-out KV logs' weights are checked with their KV budget (test_held_out_weights_within_5_percent).
    assert stating <= set(data["logs"]) | set(data["not_used"]) | set(data["kv_held_out"])
    assert not set(data["logs"]) & set(data["not_used"])


def test_a_constructed_log_is_never_accuracy_evidence():
    """The bundled vllm-mindspore example log is constructed (its first line says so): not validated against, and
    no era's published error counts it (issue 33)."""
    data = read_json(VALIDATION)
    with open(
        os.path.join(REPO, "exporter", "kvguard", "examples", "vllm-mindspore-qwen2.5-7b.log"), encoding="utf-8"
    ) as handle:
        assert handle.readline().startswith("# CONSTRUCTED, NOT A REAL LOG")
    assert "seed" in data["not_used"] and "seed" not in data["logs"]
    for log in data["logs"].values():
        assert "examples/" not in log.get("log", "")
    for era in read_json(ACCURACY)["eras"].values():
        for kind in ("weights", "activation"):
            assert "seed" not in (era.get(kind) or {}).get("logs", [])


def test_the_model_is_named_by_the_log_itself_where_the_data_says_so():
    for log_id, log in read_json(VALIDATION)["logs"].items():
        path = log.get("log") or os.path.join("tests", "data", "logs", "real", f"{log_id}.log")
        with open(os.path.join(REPO, path), encoding="utf-8") as handle:
            text = handle.read()
        if log["model_from"].startswith("the log's first line"):
            assert log["model"].split("/")[-1] in text.splitlines()[0], log_id


# ----------------------------------------------------------------------------------------- weights


@pytest.mark.parametrize("case", CASES, ids=[f"{c['id']}-{'held-out' if c['held_out'] else 'tuned'}" for c in CASES])
def test_weights_within_2_percent_of_what_the_log_states(rows, case):
    row = rows[case["id"]]
    assert "weights" in row, case["id"]
    assert abs(row["weights"]["error_pct"]) < 2.0, row["weights"]


def test_compressed_tensors_8_bit_weights_are_one_byte():
    """neuralmagic's w8a8 Llama-3.1-70B (r19): int8 linear weights (compressed_tensors_w8a8_int8.py 0.11.0:56-61),
    embeddings and the ignored lm_head in bf16; a 4-bit group is packed eight to an int32 instead
    (compressed_tensors_wNa16.py 0.11.0:113-121; tests/upstream/test_quantized_weights.py)."""
    fields = read_json(VALIDATION)["models"]["neuralmagic/Meta-Llama-3.1-70B-Instruct-quantized.w8a8"]["fields"]
    shape = model_shape(fields)
    assert (shape.weight_bytes_per_element, shape.dtype_bytes) == (1, 2)
    four_bit = json.loads(json.dumps(fields))
    four_bit["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    assert model_shape(four_bit).weight_bytes_per_element == 2
    assert sum(weight_tensors(model_shape(four_bit))) < 0.6 * sum(weight_tensors(shape))


def test_vocab_is_padded_to_a_multiple_of_64_before_the_tensor_parallel_split():
    """vocab_parallel_embedding.py 0.11.0:60-63 (pad_vocab_size), 263 (the even split)."""
    fields = dict(read_json(VALIDATION)["models"]["meta-llama/Llama-3.1-8B-Instruct"]["fields"], vocab_size=50257)
    embedding = weight_tensors(model_shape(fields, 2))[0]
    assert embedding == (50304 // 2) * 4096 * 2


# ----------------------------------------------------------------------------------------- the activation peak


def test_the_published_errors_are_the_corpus_errors_now(rows):
    """accuracy.json (what plan cites) equals what the corpus gives with this code."""
    _, eras = BENCH.era_table(list(rows.values()))
    published = read_json(ACCURACY)["eras"]
    assert set(published) == set(eras)
    for era, figures in eras.items():
        for kind in ("weights", "activation"):
            assert published[era].get(kind) == figures.get(kind), (era, kind)


def test_the_activation_error_is_measured_on_every_log_that_states_it(rows):
    with_activation = [case["id"] for case in CASES if case["stated"]["activation_gib"] is not None]
    assert len(with_activation) >= 4
    for log_id in with_activation:
        assert "activation" in rows[log_id], log_id


def test_plan_cites_the_measured_error_and_says_when_it_is_large_or_unmeasured():
    era = "vllm 0.6.4–0.8.4"
    v0 = read_json(ACCURACY)["eras"][era]["activation"]
    llama = os.path.join(DATA, "configs", "llama-3-8b-instruct")
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "--json",
            "--device",
            "H100",
            "--vllm-version",
            "0.11.0",
            "--model-config",
            llama,
            "--",
            "vllm",
            "serve",
            "m",
            "--max-model-len",
            "8192",
        ],
    )
    assert result.exit_code == 0, result.output
    note = next(n for n in json.loads(result.output)["plan"]["uncertainty"] if n.startswith("activation peak"))
    assert "UNMEASURED for vllm 0.9.1–0.11.2" in note and era in note
    assert f"{v0['worst_error_pct']:+.1f}%" in note
    assert ("LARGE" in note) == (abs(v0["worst_error_pct"]) > 25)
    result = CliRunner().invoke(
        main,
        [
            "plan",
            "--json",
            "--device",
            "910B",
            "--vllm-version",
            "vllm-mindspore:0.2.0",
            "--model-config",
            llama,
            "--",
            "vllm",
            "serve",
            "m",
            "--max-model-len",
            "8192",
        ],
    )
    assert result.exit_code == 0, result.output
    notes = json.loads(result.output)["plan"]["uncertainty"]
    assert any(
        n.startswith("activation peak") and "UNMEASURED for vllm-mindspore 0.2.0 and its allocator" in n for n in notes
    )


# ----------------------------------------------------------------------------------------- the KV budget (issue 33)

KV_CASES = BENCH.kv_cases()


@pytest.fixture(scope="module")
def kv_rows(tmp_path_factory):
    """`kvguard plan --json` (the CLI, click's runner) on each log's command, against the log's KV figure."""
    directory = str(tmp_path_factory.mktemp("kv-configs"))
    return {case["id"]: BENCH.kv_row(case, BENCH.run_plan(case, directory)) for case in KV_CASES}


def _cited_by_plan():
    cited = set()
    plan_dir = os.path.join(REPO, "exporter", "kvguard", "plan")
    for name in os.listdir(plan_dir):
        if name.endswith(".py"):
            with open(os.path.join(plan_dir, name), encoding="utf-8") as handle:
                cited |= set(re.findall(r"\br(\d\d)\b", handle.read()))
    return {f"r{number}" for number in cited}


def test_the_kv_held_out_logs_are_held_out_and_neither_tuned_on_nor_cited_by_plan():
    data = read_json(VALIDATION)
    manifest = {entry["id"]: entry for entry in read_json(MANIFEST)["logs"]}
    held_out = set(data["kv_held_out"])
    assert held_out, "no held-out log to measure the KV budget on"
    assert all(manifest[log_id]["held_out"] for log_id in held_out)
    assert not held_out & set(data["logs"])
    assert not held_out & _cited_by_plan()


def test_every_held_out_log_that_states_a_kv_figure_is_measured_or_says_why():
    data = read_json(VALIDATION)
    stating = {
        entry["id"]
        for entry in read_json(MANIFEST)["logs"]
        if entry["held_out"]
        and entry["id"] not in _cited_by_plan()
        and any(
            entry["expect"].get(key) is not None for key in ("available_kv_gib", "kv_cache_tokens", "num_gpu_blocks")
        )
    }
    assert stating == set(data["kv_held_out"]) | set(data["kv_not_measured"])
    assert not set(data["kv_held_out"]) & set(data["kv_not_measured"])


@pytest.mark.parametrize(
    "case", KV_CASES, ids=[f"{c['id']}-{'held-out' if c['held_out'] else 'tuned'}" for c in KV_CASES]
)
def test_plan_never_refuses_a_command_vllm_started(kv_rows, case):
    row = kv_rows[case["id"]]
    if row["vllm"] == "started":
        assert row["plan_starts"], row
    else:
        assert not row["false_refusal"]


@pytest.mark.parametrize(
    "case", [c for c in KV_CASES if c["held_out"]], ids=[c["id"] for c in KV_CASES if c["held_out"]]
)
def test_held_out_kv_budget_within_10_percent_or_its_miss_is_named(kv_rows, case):
    """Within the goal: the bound holds. A miss is listed in plan_validation.json 'kv_missed' with its terms; a
    listed log that comes within the goal fails here too, so the list cannot go stale."""
    row = kv_rows[case["id"]]
    missed = read_json(VALIDATION)["kv_missed"]
    if case["id"] in missed:
        assert abs(row["error_pct"]) > BENCH.KV_GOAL_PCT, (row, "now within the goal: drop it from kv_missed")
    else:
        assert abs(row["error_pct"]) <= BENCH.KV_GOAL_PCT, row


@pytest.mark.parametrize(
    "case",
    [c for c in KV_CASES if c["held_out"] and c["stated_weights_gib"] is not None],
    ids=[c["id"] for c in KV_CASES if c["held_out"] and c["stated_weights_gib"] is not None],
)
def test_held_out_weights_within_5_percent(kv_rows, case):
    """Batch 5's Qwen2-7B-Instruct logs print 'Model loading took 7.1217 GiB' (TP2) and 14.2488 GiB (TP1): plan's
    weights from the config alone (issue 33: no checkpoint's weights off by more than 5%)."""
    row = kv_rows[case["id"]]
    assert abs(row["weights_error_pct"]) <= 5.0, row


def test_the_kv_stated_figure_is_the_logs_own(kv_rows):
    """r04 prints 'Available KV cache memory: 8.11 GiB'; r05 only tokens, in bytes with plan's page (Llama-3.1-8B:
    32 layers x 8 KV heads x 128 x K and V x 2 bytes = 131,072 B a token)."""
    with open(os.path.join(DATA, "logs", "real", "r04.log"), encoding="utf-8") as handle:
        assert "Available KV cache memory: 8.11 GiB" in handle.read()
    assert kv_rows["r04"]["stated_gib"] == 8.11
    assert kv_rows["r05"]["stated_gib"] == round(158656 * 131072 / GIB, 3)
