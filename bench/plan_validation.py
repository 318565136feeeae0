"""kvguard plan's predictions against the real logs that state them: weights and the activation peak, per log
and per era, tuned and held-out apart (issue 20, deliverable 4).

For every log in tests/data/plan_validation.json, runs ``kvguard plan --json`` (the CLI, as a user would) with the
model's config.json fields, the serve settings the log's release ran and its device, and compares:

- weights: plan["weights"]["bytes"] with the log's "model weights take" / "Loading model weights took" figure
  (tests/data/logs/real/MANIFEST.json expect.weights_gib);
- activation: plan["activation_peak"]["allocated_increase_bytes"] with the log's "PyTorch activation peak memory"
  (expect.peak_activation_gib), or the difference of two figures it prints (derived_activation_gib, named there).

and, for the KV budget (issue 33), plan["budgets"]["stock"]["kv_cache_bytes"] with the log's "Available KV cache
memory" / "GPU KV cache size" tokens / "# GPU blocks" (in bytes with plan's page size), per device, on the held-out
logs (HELD_OUT_RULE, written before any KV figure was computed) and the tuned ones apart, with every log where vLLM
started and plan says it does not (a false refusal).

Errors are (predicted - stated), in GiB and in percent of the stated figure. Prints the table and, with
``--write-accuracy``, writes exporter/kvguard/plan/accuracy.json, the per-era errors plan's output cites.

    .venv/bin/python bench/plan_validation.py [--write-accuracy]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from click.testing import CliRunner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data", "plan_validation.json")
MANIFEST = os.path.join(REPO, "tests", "data", "logs", "real", "MANIFEST.json")
ACCURACY = os.path.join(REPO, "exporter", "kvguard", "plan", "accuracy.json")
GIB = 1 << 30
# Errors above these are called large in plan's output (kvguard.plan.planner._predicted_uncertainty).
LARGE_PCT = {"weights": 2.0, "activation": 25.0}


def load_cases() -> list[dict]:
    """One case per log: the plan arguments and the stated figures, from the data file and the manifest."""
    with open(DATA, encoding="utf-8") as handle:
        data = json.load(handle)
    with open(MANIFEST, encoding="utf-8") as handle:
        manifest = {entry["id"]: entry for entry in json.load(handle)["logs"]}
    cases = []
    for log_id, log in data["logs"].items():
        model = data["models"][log["model"]]
        # Real logs only: every case is a corpus log (a constructed log is never evidence, issue 33).
        entry = manifest[log_id]
        stated = {
            "weights_gib": entry["expect"].get("weights_gib"),
            "activation_gib": entry["expect"].get("peak_activation_gib"),
        }
        # A release the era table does not place: its project, release unknown.
        era = entry["era"] or f"{entry['release'].split(' ')[0]} (release unknown)"
        held_out = entry["held_out"]
        derived = log.get("derived_activation_gib")
        if stated["activation_gib"] is None and derived is not None:
            stated["activation_gib"] = derived["value"]
            stated["activation_derived"] = True
        cases.append(
            {
                "id": log_id,
                "model": log["model"],
                "model_entry": model,
                "serve": log["serve"],
                "device": log["device"],
                "release": log["plan_release"],
                "era": era,
                "held_out": held_out,
                "stated": stated,
            }
        )
    return cases


def config_path(case: dict, directory: str) -> str:
    model = case["model_entry"]
    if "config_dir" in model:
        return os.path.join(REPO, model["config_dir"])
    path = os.path.join(directory, case["id"] + ".json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(model["fields"], handle)
    return path


def run_plan(case: dict, directory: str) -> dict:
    """``kvguard plan --json`` for one case; exit 2 (CRITICAL: vLLM would refuse) still prints the plan."""
    from kvguard.cli import exits, main

    args = [
        "plan",
        "--json",
        "--device",
        case["device"],
        "--vllm-version",
        case["release"],
        "--model-config",
        config_path(case, directory),
        "--",
        *case["serve"],
    ]
    result = CliRunner().invoke(main, args)
    if result.exit_code not in (exits.OK, exits.CRITICAL):
        raise RuntimeError(f"{case['id']}: kvguard plan exited {result.exit_code}: {result.output.strip()}")
    return json.loads(result.output)


def compared(predicted_gib: float, stated_gib: float) -> dict:
    """A figure plan predicts against the one a log states: both, and the error in GiB and percent of the stated."""
    return {
        "stated_gib": stated_gib,
        "predicted_gib": round(predicted_gib, 4),
        "error_gib": round(predicted_gib - stated_gib, 4),
        "error_pct": round(100 * (predicted_gib - stated_gib) / stated_gib, 2),
    }


def errors(case: dict, out: dict) -> dict:
    plan = out["plan"]
    row = {
        "id": case["id"],
        "model": case["model"],
        "era": case["era"],
        "held_out": case["held_out"],
        "release": case["release"],
        "tp": plan["settings"]["tensor_parallel_size"]["value"],
    }
    stated_w = case["stated"]["weights_gib"]
    if stated_w is not None:
        row["weights"] = compared(plan["weights"]["bytes"] / GIB, stated_w)
    stated_a = case["stated"]["activation_gib"]
    peak = plan.get("activation_peak")
    if stated_a is not None and peak is not None:
        row["activation"] = {
            **compared(peak["allocated_increase_bytes"] / GIB, stated_a),
            "tokens": peak["max_num_batched_tokens"],
            "seqs": peak["num_seqs"],
            "derived": bool(case["stated"].get("activation_derived")),
        }
    return row


def summary(rows: list[dict], kind: str) -> dict | None:
    got = [row[kind] for row in rows if kind in row]
    if not got:
        return None
    worst = max(got, key=lambda e: abs(e["error_pct"]))
    return {
        "n": len(got),
        "median_abs_error_gib": round(statistics.median(abs(e["error_gib"]) for e in got), 3),
        "median_abs_error_pct": round(statistics.median(abs(e["error_pct"]) for e in got), 1),
        "worst_error_gib": round(max((e["error_gib"] for e in got), key=abs), 3),
        "worst_error_pct": worst["error_pct"],
        "logs": [row["id"] for row in rows if kind in row],
        "large": abs(worst["error_pct"]) > LARGE_PCT[kind],
    }


def table(rows: list[dict]) -> list[str]:
    lines = [
        f"{'log':<5} {'set':<8} {'era':<30} {'model':<48} {'TP':>2}  {'weights stated/pred GiB (err %)':<32} "
        f"{'activation stated/pred GiB (err %) at tokens':<44}"
    ]
    for row in rows:
        w = row.get("weights")
        a = row.get("activation")
        wt = f"{w['stated_gib']:.4g} / {w['predicted_gib']:.4g} ({w['error_pct']:+.2f}%)" if w else "-"
        at = (
            (
                f"{a['stated_gib']:.3g} / {a['predicted_gib']:.3g} ({a['error_pct']:+.0f}%) at {a['tokens']}"
                + (" [derived]" if a["derived"] else "")
            )
            if a
            else "-"
        )
        lines.append(
            f"{row['id']:<5} {'held-out' if row['held_out'] else 'tuned':<8} {row['era']:<30} "
            f"{row['model']:<48} {row['tp']:>2}  {wt:<32} {at:<44}"
        )
    return lines


def era_table(rows: list[dict]) -> tuple[list[str], dict]:
    eras: dict[str, dict] = {}
    lines = [f"{'era':<30} {'set':<9} {'what':<11} {'n':>2} {'median |err|':>20} {'worst err':>20}"]
    for era in dict.fromkeys(row["era"] for row in rows):
        in_era = [row for row in rows if row["era"] == era]
        eras[era] = {}
        for label, subset in (
            ("tuned", [r for r in in_era if not r["held_out"]]),
            ("held-out", [r for r in in_era if r["held_out"]]),
            ("all", in_era),
        ):
            for kind in ("weights", "activation"):
                s = summary(subset, kind)
                if s is None:
                    continue
                if label == "all":
                    eras[era][kind] = s
                lines.append(
                    f"{era:<30} {label:<9} {kind:<11} {s['n']:>2} "
                    f"{s['median_abs_error_gib']:>8.3f} GiB {s['median_abs_error_pct']:>6.1f}% "
                    f"{s['worst_error_gib']:>+8.3f} GiB {s['worst_error_pct']:>+6.1f}%"
                )
    return lines, eras


# ----------------------------------------------------------------------------------------- the KV budget (issue 33)

# Written down before any KV figure was computed (2026-12-07), and not changed after: which real logs count as
# "not tuned on" for the KV budget. (2026-12-08: "batches 2-4" became "2-5" when batch 5 joined the manifest under the
# manifest's own rule; nothing else.)
HELD_OUT_RULE = (
    "held out for the KV budget: a real log (tests/data/logs/real) that (1) MANIFEST.json marks held_out (the id % 4 "
    "== 0 rule and batches 2-5 whole, each fixed before kvguard was run on them), (2) is cited by no plan constant "
    "(exporter/kvguard/plan/devices.py cites r01, r09, r38, r39, r43, r47, r52 for device totals) and (3) is not one "
    "of plan_validation.json's 'logs' (r01, r05, r18, r19, r21, r22, r34, r38: the weights and activation "
    "figures plan was checked and tuned against). Such a log is measured when it states a KV figure, its "
    "model is named by the log or its thread (never guessed from a figure) with its config.json fields at hand, "
    "and its device is a named device; the others are listed with why (plan_validation.json 'kv_not_measured'). "
    "The tuned logs are measured too and reported apart, as context: not the goal's figure."
)
# The goal (issue 33): each named device's median |error| within this, on the held-out logs.
KV_GOAL_PCT = 10.0


def kv_cases() -> list[dict]:
    """The tuned logs and the held-out ones (plan_validation.json 'kv_held_out') that state a KV figure."""
    with open(DATA, encoding="utf-8") as handle:
        data = json.load(handle)
    with open(MANIFEST, encoding="utf-8") as handle:
        manifest = {entry["id"]: entry for entry in json.load(handle)["logs"]}
    cases = []
    for held_out, logs in ((False, data["logs"]), (True, data["kv_held_out"])):
        for log_id, log in logs.items():
            entry = manifest[log_id]
            expect = entry["expect"]
            stated = {key: expect.get(key) for key in ("available_kv_gib", "kv_cache_tokens", "num_gpu_blocks")}
            if all(value is None for value in stated.values()):
                continue
            cases.append(
                {
                    "id": log_id,
                    "model": log["model"],
                    "model_entry": data["models"][log["model"]],
                    "serve": log["serve"],
                    "device": log["device"],
                    "release": log["plan_release"],
                    "held_out": held_out,
                    "manifest_held_out": entry["held_out"],
                    "device_text": entry["device"],
                    "stated": stated,
                    "stated_weights_gib": expect.get("weights_gib"),
                    # vLLM did not start: a refusal, or a KV budget <= 0 (the manifest's critical verdict).
                    "vllm_refused": expect.get("refusal")
                    or (entry["outcome"].split(":")[0] if entry["verdict"] == "critical" else None),
                    "outcome": entry["outcome"],
                }
            )
    return cases


def kv_row(case: dict, out: dict) -> dict:
    """plan's KV budget (the era's formula, per rank) against the log's: its GiB figure where it prints one, else
    its tokens or blocks in bytes with plan's own page size (the layout is exact; only the budget is predicted)."""
    block_size = out["layout"]["block_size"]
    bytes_per_token = out["block_bytes"] // block_size
    stated = case["stated"]
    if stated["available_kv_gib"] is not None:
        stated_bytes, stated_from = stated["available_kv_gib"] * GIB, f"{stated['available_kv_gib']} GiB"
    elif stated["kv_cache_tokens"] is not None:
        stated_bytes = stated["kv_cache_tokens"] * bytes_per_token
        stated_from = f"{stated['kv_cache_tokens']:,} tokens x {bytes_per_token:,} B"
    else:
        stated_bytes = stated["num_gpu_blocks"] * out["block_bytes"]
        stated_from = f"{stated['num_gpu_blocks']:,} blocks x {out['block_bytes']:,} B"
    predicted = out["budgets"]["stock"]["kv_cache_bytes"]
    plan_starts = bool(out["plan"]["will_start"])
    weights = case["stated_weights_gib"]
    weighed = None if weights is None else compared(out["plan"]["weights"]["bytes"] / GIB, weights)
    weights_error_pct = None if weighed is None else weighed["error_pct"]
    started = case["vllm_refused"] is None
    return {
        "id": case["id"],
        "held_out": case["held_out"],
        "device": case["device"],
        "device_text": case["device_text"],
        "model": case["model"],
        "release": case["release"],
        "tp": out["plan"]["settings"]["tensor_parallel_size"]["value"],
        "stated_gib": round(stated_bytes / GIB, 3),
        "stated_from": stated_from,
        "predicted_gib": round(predicted / GIB, 3),
        "error_gib": round((predicted - stated_bytes) / GIB, 3),
        "error_pct": round(100 * (predicted - stated_bytes) / abs(stated_bytes), 1),
        "vllm": "started" if started else f"refused ({case['vllm_refused']})",
        "plan_starts": plan_starts,
        "false_refusal": started and not plan_starts,
        "missed_refusal": not started and plan_starts,
        "refusals": [r.get("reason", r) if isinstance(r, dict) else r for r in out["plan"]["refusals"]],
        "stated_weights_gib": weights,
        "weights_error_pct": weights_error_pct,
    }


def kv_rows(directory: str) -> list[dict]:
    return [kv_row(case, run_plan(case, directory)) for case in kv_cases()]


def kv_devices(rows: list[dict]) -> dict:
    """Per device (the --device plan ran with): n, median and worst error, and whether the median meets the goal."""
    devices: dict[str, dict] = {}
    for device in dict.fromkeys(row["device"] for row in rows):
        got = [row for row in rows if row["device"] == device]
        worst = max(got, key=lambda row: abs(row["error_pct"]))
        median = statistics.median(abs(row["error_pct"]) for row in got)
        devices[device] = {
            "n": len(got),
            "logs": [row["id"] for row in got],
            "median_abs_error_pct": round(median, 1),
            "median_abs_error_gib": round(statistics.median(abs(row["error_gib"]) for row in got), 3),
            "worst_error_pct": worst["error_pct"],
            "worst_error_gib": worst["error_gib"],
            "within_goal": median <= KV_GOAL_PCT,
        }
    return devices


def kv_lines(rows: list[dict]) -> list[str]:
    lines = [
        f"{'log':<5} {'set':<8} {'device':<10} {'model':<40} {'TP':>2} {'release':<8} {'stated GiB':>10} "
        f"{'plan GiB':>9} {'err GiB':>8} {'err %':>7}  {'vLLM':<22} {'plan':<8} stated from"
    ]
    for row in rows:
        lines.append(
            f"{row['id']:<5} {'held-out' if row['held_out'] else 'tuned':<8} {row['device']:<10} "
            f"{row['model'][:40]:<40} {row['tp']:>2} {row['release']:<8} {row['stated_gib']:>10.2f} "
            f"{row['predicted_gib']:>9.2f} {row['error_gib']:>+8.2f} {row['error_pct']:>+6.1f}%  "
            f"{row['vllm']:<22} {'starts' if row['plan_starts'] else 'refuses':<8} {row['stated_from']}"
        )
    for label, subset in (
        ("held-out", [r for r in rows if r["held_out"]]),
        ("tuned (context)", [r for r in rows if not r["held_out"]]),
    ):
        lines.append("")
        lines.append(
            f"per device, {label}: {'device':<10} {'n':>2} {'median |err|':>20} {'worst err':>20}  goal "
            f"(median within {KV_GOAL_PCT:g}%)"
        )
        for device, s in kv_devices(subset).items():
            lines.append(
                f"{'':<{len(label) + 12}} {device:<10} {s['n']:>2} {s['median_abs_error_gib']:>8.2f} GiB "
                f"{s['median_abs_error_pct']:>7.1f}% {s['worst_error_gib']:>+8.2f} GiB "
                f"{s['worst_error_pct']:>+7.1f}%  {'holds' if s['within_goal'] else 'MISSED'}  "
                f"({', '.join(s['logs'])})"
            )
        false = [r["id"] for r in subset if r["false_refusal"]]
        missed = [r["id"] for r in subset if r["missed_refusal"]]
        lines.append(
            f"{'':<{len(label) + 12}} false refusals (vLLM started, plan says it does not): "
            f"{', '.join(false) or 'none'} of {sum(r['vllm'] == 'started' for r in subset)} started; "
            f"refusals plan missed: {', '.join(missed) or 'none'} of "
            f"{sum(r['vllm'] != 'started' for r in subset)} refused"
        )
    weighed = [r for r in rows if r["held_out"] and r["weights_error_pct"] is not None]
    if weighed:
        lines.append("")
        lines.append("weights on the held-out KV logs that state them ('Model loading took', per rank):")
        for row in weighed:
            lines.append(
                f"  {row['id']:<5} {row['model'][:40]:<40} TP{row['tp']:<2} "
                f"stated {row['stated_weights_gib']:.4f} GiB, plan {row['weights_error_pct']:+.2f}%"
            )
    return lines


# The seed's two published runs (vllm-mindspore 0.2.0, 64 GB 910B): (GiB, blocks) per formula. Its commands:
# tests/plan/test_plan_seed.py (SEED_QWEN; test_plan.py's SEED_DSV3 and DEEPSEEK_V3).
SEED_PUBLISHED = {
    "Qwen2.5-7B-Instruct TP1": {"stock": (37.85, 44292), "reserved": (36.40, 42593)},
    "DeepSeek-V3 TP16": {"stock": (9.13, 8719), "reserved": (8.54, 8150)},
}


def seed_lines(directory: str) -> list[str]:
    """plan against the seed's published budgets, both formulas: vLLM's stock (allocated peak) and
    vllm-mindspore 0.2.0's reserved fix, from plan's one predicted profile."""
    import dataclasses

    sys.path[:0] = [
        os.path.join(REPO, "tests"),
        os.path.join(REPO, "tests", "support"),
        os.path.join(REPO, "tests", "plan"),
    ]
    from test_plan import DEEPSEEK_V3, SEED_DSV3
    from test_plan_seed import SEED_QWEN

    from kvguard.budget.estimator import Profile, estimate
    from kvguard.cli import main as cli

    path = os.path.join(directory, "deepseek-v3.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(DEEPSEEK_V3, handle)
    qwen = os.path.join(REPO, "exporter", "kvguard", "examples", "qwen2.5-7b-instruct")
    lines = [
        f"{'seed run':<26} {'formula':<9} {'published GiB / blocks':>24} {'plan GiB / blocks':>20} "
        f"{'error GiB':>9} {'error %':>8}"
    ]
    for name, (config, command) in {
        "Qwen2.5-7B-Instruct TP1": (qwen, SEED_QWEN),
        "DeepSeek-V3 TP16": (path, SEED_DSV3),
    }.items():
        result = CliRunner().invoke(
            cli,
            [
                "plan",
                "--json",
                "--device",
                "910B",
                "--vllm-version",
                "vllm-mindspore:0.2.0",
                "--model-config",
                config,
                "--",
                *command,
            ],
        )
        out = json.loads(result.output)
        profile = Profile.from_dict(out["profile"])
        for formula, era_formula in (("stock", "peak"), ("reserved", "mindspore_reserved")):
            kv = estimate(dataclasses.replace(profile, formula=era_formula)).stock.kv_cache_bytes
            gib, blocks = kv / GIB, kv // out["block_bytes"]
            published_gib, published_blocks = SEED_PUBLISHED[name][formula]
            lines.append(
                f"{name:<26} {formula:<9} {published_gib:>13.2f} / {published_blocks:>7,} "
                f"{gib:>9.2f} / {blocks:>7,} {gib - published_gib:>+9.2f} "
                f"{100 * (gib - published_gib) / published_gib:>+7.1f}%"
            )
        non_torch = out["plan"]["non_torch"]
        lines.append(
            f"{'':<26} per rank: weights {out['plan']['weights']['bytes'] / GIB:.2f} GiB, activation "
            f"+{profile.peak_allocated_increase_bytes / GIB:.2f} allocated / "
            f"+{profile.peak_reserved_increase_bytes / GIB:.2f} reserved, non-torch increase "
            f"{non_torch['increase_bytes'] / GIB:.2f} GiB, device {profile.total_memory_bytes:,} B"
        )
    return lines


def main(argv: list[str]) -> int:
    cases = load_cases()
    with tempfile.TemporaryDirectory() as directory:
        rows = [errors(case, run_plan(case, directory)) for case in cases]
    try:
        commit = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    print(
        f"kvguard plan against the real logs that state weights or the activation peak (commit {commit}, working tree)"
    )
    print("error = predicted - stated; held-out: the manifest's rule (id % 4 == 0), written before tuning\n")
    for line in table(rows):
        print(line)
    print()
    print("the seed's published runs (vllm-mindspore 0.2.0 on 910B; targets: Qwen within 2%, DeepSeek-V3 within 10%)")
    with tempfile.TemporaryDirectory() as directory:
        for line in seed_lines(directory):
            print(line)
    print()
    print("plan's KV budget (per rank, the era's formula) against the figure each real log states (issue 33)")
    print(HELD_OUT_RULE)
    with tempfile.TemporaryDirectory() as directory:
        for line in kv_lines(kv_rows(directory)):
            print(line)
    print("\nheld-out logs that state a KV figure but are not measured (plan_validation.json 'kv_not_measured'):")
    with open(DATA, encoding="utf-8") as handle:
        for log_id, why in json.load(handle)["kv_not_measured"].items():
            print(f"  {log_id}: {why}")
    print()
    lines, eras = era_table(rows)
    for line in lines:
        print(line)
    if not any(row["held_out"] for row in rows):
        print(
            "\nheld-out: no figure. The held-out logs that state weights or the activation peak (r20, r36) do "
            "not name their model;\nthey are listed as not used below, not dropped for their errors."
        )
    print("\nnot used (tests/data/plan_validation.json 'not_used'):")
    with open(DATA, encoding="utf-8") as handle:
        for log_id, why in json.load(handle)["not_used"].items():
            print(f"  {log_id}: {why}")
    if "--write-accuracy" in argv:
        from kvguard.vllm.eras import ERAS

        # The allocator of each era's release (the era table's); an unknown release: its project's newest row's.
        allocators = {era.name: era.allocator for era in ERAS}
        for era in ERAS:
            allocators[f"{era.project} (release unknown)"] = era.allocator
        accuracy = {
            "about": (
                "kvguard plan's prediction errors against the real logs that state them (predicted - stated), "
                "per era of the log's release; written by bench/plan_validation.py --write-accuracy from "
                "tests/data/plan_validation.json. Read by kvguard.plan.planner._predicted_uncertainty."
            ),
            "results": "bench/results/plan-validation-2026-12-07.txt",
            "commit": commit,
            "large_pct": LARGE_PCT,
            "eras": {era: {"allocator": allocators.get(era), **figures} for era, figures in eras.items()},
        }
        with open(ACCURACY, "w", encoding="utf-8") as handle:
            json.dump(accuracy, handle, indent=1, ensure_ascii=False)
            handle.write("\n")
        print(f"\nwrote {os.path.relpath(ACCURACY, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
