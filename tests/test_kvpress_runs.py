"""kvpress's layout both ways: the kvpress_dataset task over rows in kvpress's schema, export of a run to
kvpress's directory (names, columns, metric keys, config fields), import of such directories (ours and a
hand-written kvpress one) into results.csv and the summary, and the refusals of bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from errors import UserError, run_cli
from eval import cli, kvpress_runs, plot, results
from tests.eval_helpers import (
    byte_tokenizer,
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    read_results,
)

# kvpress's EvaluationConfig fields (evaluation/evaluate.py), in its order, as save_config writes them when
# neither threshold nor head_compression_ratio is set.
KVPRESS_CONFIG_FIELDS = ["dataset", "data_dir", "model", "device", "press_name", "compression_ratio",
                         "key_channel_compression_ratio", "fraction", "max_new_tokens", "max_context_length",
                         "query_aware", "needle_depth", "compression_interval", "target_size",
                         "hidden_states_buffer_size", "output_dir", "log_level", "model_kwargs", "press_init_command",
                         "seed", "fp8"]
FILLER = "The grass is green. The sky is blue. "


def ruler_rows() -> list[dict]:
    """Two RULER tasks with their own answer lengths; qa_1 takes any reference, niah all of them."""
    rows = []
    for i in range(3):
        rows.append({"context": FILLER * 6 + f"The magic number is {1000 + i}. " + FILLER * 2,
                     "question": "What is the magic number?", "answer_prefix": "Answer:",
                     "answer": [str(1000 + i), "7"], "task": "niah_single_1", "max_new_tokens": 5})
        rows.append({"context": FILLER * 4 + "Paris is in France. ", "question": "Where is Paris?",
                     "answer_prefix": "Answer:", "answer": ["France", "e"], "task": "qa_1", "max_new_tokens": 3})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def kvpress_task_score(task: str, preds: list[str], refs: list[list[str]]) -> float:
    """kvpress's ruler calculate_metrics for one task, retyped (control characters deleted, then match)."""
    preds = [re.sub(r"[\x00-\x1f]", "", p.strip()).strip() for p in preds]
    if task.split("_")[0] == "qa":
        hits = [max(1.0 if r.lower() in p.lower() else 0.0 for r in ref) for p, ref in zip(preds, refs, strict=True)]
    else:
        hits = [sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref)
                for p, ref in zip(preds, refs, strict=True)]
    return round(sum(hits) / len(preds) * 100, 2)


def run_ours(tiny_dir, tmp_path, *more):
    data = write_jsonl(tmp_path / "ruler.jsonl", ruler_rows())
    out = tmp_path / "out"
    kvpress_runs.main(["run", "--compression_ratio", "0.5", "--dataset", str(data), "--checkpoint_path",
                       str(tiny_dir), "--cache_strategy", "recent_global", "--out_dir", str(out), *more])
    dirs = {d.name.split("-")[0]: d for d in (p.parent for p in out.glob("*/kvpress_dataset/*/metrics.json"))}
    return out, dirs


def test_kvpress_dataset_runs_each_task_and_scores_it_as_kvpress(tiny_dir, tmp_path):
    out, dirs = run_ours(tiny_dir, tmp_path)
    assert set(dirs) == {"full", "recent_global"}
    for run in dirs.values():
        metrics = json.loads((run / "metrics.json").read_text())
        preds = [json.loads(x) for x in (run / "predictions.jsonl").read_text().splitlines()]
        items = results.read_items(run)
        assert metrics["n_items"] == 6 and [p["index"] for p in preds] == list(range(6))
        by_task = {}
        for p, it in zip(preds, items, strict=True):
            by_task.setdefault(p["task"], []).append(p)
            assert len(it["output_ids"]) <= {"niah_single_1": 5, "qa_1": 3}[p["task"]]  # the row's own length
            n_context = len(it["context_ids"])
            if run.name.startswith("recent_global"):  # kvpress: int(k_len * (1 - compression_ratio)) kept
                assert p["context_budget"] == int(n_context * (1 - 0.5))
                assert p["context_compression_ratio"] == pytest.approx(1 - int(n_context * 0.5) / n_context)
        expected = {t: kvpress_task_score(t, [p["prediction"] for p in ps], [p["answers"] for p in ps])
                    for t, ps in by_task.items()}
        assert {t: metrics[f"score_{t}"] for t in expected} == expected
        assert metrics["score"] == pytest.approx(sum(expected.values()) / 2)
    # kvpress without a chat template puts a newline between the question and the answer prefix.
    tokens = results.read_items(dirs["full"])[0]["question_ids"]
    assert byte_tokenizer().decode(tokens) == "What is the magic number?\nAnswer:"


def test_export_then_import_round_trips_a_run(tiny_dir, tmp_path):
    out, dirs = run_ours(tiny_dir, tmp_path, "--query_aware")
    kv = tmp_path / "kvpress"
    kvpress_runs.main(["export", *map(str, dirs.values()), "--to", str(kv), "--model", "org/tiny",
                       "--data_dir", "512"])
    names = sorted(p.name for p in kv.iterdir())
    assert names == ["ruler__512__org--tiny__no_press__0.00__query_aware",
                     "ruler__512__org--tiny__recent_global__0.50__query_aware"]
    ours = json.loads((dirs["recent_global"] / "metrics.json").read_text())
    exported = kv / names[1]
    frame = pd.read_csv(exported / "predictions.csv")
    assert {"question", "answer_prefix", "answer", "task", "max_new_tokens", "predicted_answer",
            "compression_ratio"} <= set(frame.columns) and "context" not in frame
    assert (frame["compression_ratio"] == 0.5).all()
    metrics = json.loads((exported / "metrics.json").read_text())
    rescored = {t: {"string_match": kvpress_task_score(t, list(g["predicted_answer"].fillna("").astype(str)),
                                                       [eval(a) for a in g["answer"]])}
                for t, g in frame.groupby("task")}
    assert metrics == rescored == {t: {"string_match": ours[f"score_{t}"]} for t in ("niah_single_1", "qa_1")}
    config = yaml.safe_load((exported / "config.yaml").read_text())
    assert [k for k in config if k != kvpress_runs.EXPORT_MARK] == KVPRESS_CONFIG_FIELDS
    assert config["press_name"] == "recent_global" and config["compression_ratio"] == 0.5 and config["query_aware"]

    back = tmp_path / "back"
    kvpress_runs.main(["import", str(kv), "--out_dir", str(back)])
    table = read_results(back / "results.csv").set_index("strategy")
    row = table.loc["recent_global"]
    assert row["model"] == "tiny" and row["budget"] == 0.5 and bool(row["query_aware"])
    assert row["score"] == pytest.approx(ours["score"]) and row["score_rescored"] == pytest.approx(ours["score"])
    assert row["score_qa_1"] == ours["score_qa_1"] and row["compression_ratio"] == ours["compression_ratio"]
    assert row["context_compression_ratio"] == pytest.approx(ours["context_compression_ratio"])
    assert row["n_items"] == 6 and table.loc["full", "budget"] == 1.0


def write_kvpress_dir(root, name, config, metrics, predictions=None):
    """A directory as kvpress's evaluate.py leaves it."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.dump(config, sort_keys=False))
    (d / "metrics.json").write_text(json.dumps(metrics, indent=4))
    if predictions is not None:
        (d / "predictions.csv").write_text(predictions)
    return d


KVPRESS_CONFIG = {"dataset": "ruler", "data_dir": "4096", "model": "meta-llama/Meta-Llama-3.1-8B-Instruct",
                  "device": "cuda:0", "press_name": "knorm", "compression_ratio": 0.25,
                  "key_channel_compression_ratio": None, "fraction": 1.0, "max_new_tokens": None,
                  "max_context_length": None, "query_aware": False, "needle_depth": None, "compression_interval": None,
                  "target_size": None, "hidden_states_buffer_size": None, "output_dir": "./results",
                  "log_level": "INFO", "model_kwargs": {}, "press_init_command": "KnormPress(compression_ratio=0.25)",
                  "seed": 42, "fp8": False}
# kvpress's columns come out in set order, and pandas writes the dataset's numpy arrays as `['a' 'b']`.
KVPRESS_PREDICTIONS = (
    "max_new_tokens,predicted_answer,task,compression_ratio,answer,question,answer_prefix\n"
    "128,The numbers are 11 and 22.,niah_multivalue,0.25,['11' '22'],q,The special\n"
    "128,Only 33.,niah_multivalue,0.25,['33' '44'],q,The special\n"
    "32,Paris,qa_1,0.25,['London' 'Paris'],q,Answer:\n"
    "32,Rome,qa_1,0.25,['Berlin'],q,Answer:\n")


def test_import_of_a_kvpress_directory_sits_next_to_our_runs(tiny_dir, tmp_path):
    out, _ = run_ours(tiny_dir, tmp_path)
    kv = tmp_path / "kvpress_results"
    write_kvpress_dir(kv, "ruler__4096__meta-llama--Meta-Llama-3.1-8B-Instruct__knorm__0.25", KVPRESS_CONFIG,
                      {"niah_multivalue": {"string_match": 75.0}, "qa_1": {"string_match": 50.0}}, KVPRESS_PREDICTIONS)
    lb = {**KVPRESS_CONFIG, "dataset": "longbench", "data_dir": "hotpotqa", "compression_ratio": 0.5}
    write_kvpress_dir(kv, "longbench__hotpotqa__meta-llama--Meta-Llama-3.1-8B-Instruct__knorm__0.50", lb, 41.5)
    model = tiny_dir.name  # our runs' model name: one table for both
    run_cli(kvpress_runs.main, ["import", str(kv), "--out_dir", str(out), "--model", model])
    table = read_results(out / "results.csv")
    imported = table[table["source"] == "kvpress"].set_index("imported_from")
    ruler = imported.loc["ruler__4096__meta-llama--Meta-Llama-3.1-8B-Instruct__knorm__0.25"]
    assert ruler["strategy"] == "kvpress:knorm" and ruler["budget"] == 0.75 and ruler["compression_ratio"] == 0.25
    assert ruler["score"] == 62.5 and ruler["score_niah_multivalue"] == 75.0 and ruler["n_items"] == 4
    # Our scorer on kvpress's predictions gives kvpress's numbers (11, 22 both found; 33 of 33, 44: half).
    assert ruler["score_rescored"] == 62.5 and ruler["score_qa_1_rescored"] == 50.0
    hotpot = imported.loc["longbench__hotpotqa__meta-llama--Meta-Llama-3.1-8B-Instruct__knorm__0.50"]
    assert hotpot["score_hotpotqa"] == 41.5 and hotpot["score"] == 41.5 and hotpot["budget"] == 0.5
    assert set(table["strategy"]) == {"full", "recent_global", "kvpress:knorm"}
    plot.main(["--out_dir", str(out)])
    summary = (out / "summary.md").read_text()
    board = summary[summary.index("Per task (kvpress_dataset"):]
    assert f"| {model} | kvpress:knorm | False | 0.25 | 4 | 62.5 |  | 75 |  | 50 | kvpress |" in board
    assert f"| {model} | recent_global | False | 0.5 | 6 |" in board and "| ours |" in board


def fails(capsys, argv, *needles, after_progress=False):
    """Exit 2 with one `error:` line on stderr (after eval's `run: ...` progress lines, where it had begun)."""
    with pytest.raises(SystemExit) as exit_:
        run_cli(kvpress_runs.main, argv)
    lines = capsys.readouterr().err.strip().splitlines()
    if after_progress:
        lines = [line for line in lines if not line.startswith("run: ")]
    err = "\n".join(lines)
    assert exit_.value.code == 2 and len(lines) == 1 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.mark.parametrize("change, needles", [
    (lambda rows: [{k: v for k, v in r.items() if k != "question"} for r in rows], ["no column 'question'"]),
    (lambda rows: [{k: v for k, v in r.items() if k != "answer"} for r in rows], ["'answer (or answers)'"]),
    (lambda rows: rows[:3] + [{**rows[3], "task": "squad"}], ["row 3, column 'task'", "unknown task 'squad'"]),
    (lambda rows: rows[:2] + [{**rows[2], "answer": 1002}], ["row 2, column 'answer'", "int 1002"]),
    (lambda rows: rows[:1] + [{**rows[1], "answer": [3]}], ["row 1, column 'answer'", "list of strings"]),
    (lambda rows: rows[:4] + [{**rows[4], "max_new_tokens": 0}], ["row 4, column 'max_new_tokens'"]),
    (lambda rows: rows[:5] + [{**rows[5], "task": "hotpotqa", "answers": ["x"]}], ["mixes RULER and LongBench"]),
])
def test_bad_datasets_are_refused_in_one_line_before_anything_is_written(tiny_dir, tmp_path, capsys, change,
                                                                         needles):
    data = write_jsonl(tmp_path / "bad.jsonl", change(ruler_rows()))
    out = tmp_path / "out"
    fails(capsys, ["run", "--compression_ratio", "0.5", "--dataset", str(data), "--checkpoint_path", str(tiny_dir),
                   "--cache_strategy", "recent_global", "--out_dir", str(out)], str(data), *needles)
    assert not out.exists()


@pytest.mark.parametrize("ratio", ["1.0", "-0.1", "1.5"])
def test_a_ratio_outside_0_1_is_refused(tiny_dir, tmp_path, capsys, ratio):
    fails(capsys, ["run", "--compression_ratio", ratio, "--dataset", "x.jsonl"], "--compression_ratio", "[0, 1)")


def test_bad_kvpress_directories_are_refused_by_file_and_field(tmp_path, capsys):
    kv = tmp_path / "kv"
    d = write_kvpress_dir(kv, "a", {**KVPRESS_CONFIG, "compression_ratio": 1.5}, {"qa_1": {"string_match": 1}})
    fails(capsys, ["import", str(kv), "--out_dir", str(tmp_path / "o")], str(d / "config.yaml"), "compression_ratio")
    (d / "config.yaml").write_text(yaml.dump(KVPRESS_CONFIG))
    (d / "metrics.json").write_text(json.dumps({"qa_9": {"string_match": 1}}))
    fails(capsys, ["import", str(kv), "--out_dir", str(tmp_path / "o")], str(d / "metrics.json"), "'qa_9'")
    (d / "metrics.json").write_text(json.dumps({"qa_1": {"string_match": 1}}))
    (d / "predictions.csv").write_text("task,predicted_answer,answer\nqa_1,x,[7]\n")
    fails(capsys, ["import", str(kv), "--out_dir", str(tmp_path / "o")], "predictions.csv row 0, column 'answer'")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("predictions, needles", [
    (KVPRESS_PREDICTIONS.splitlines()[0] + "\n", ["predictions.csv: no prediction rows"]),
    (KVPRESS_PREDICTIONS.replace(",qa_1,", ",qa_2,"), ["its tasks (niah_multivalue, qa_2) are not metrics.json's "
                                                        "(niah_multivalue, qa_1)"]),
    (KVPRESS_PREDICTIONS.replace("Rome,qa_1", "Rome,squad"), ["predictions.csv row 3: unknown task 'squad'"]),
], ids=["header only", "another run's tasks", "unknown task"])
def test_predictions_that_cannot_be_rescored_are_refused_by_file_and_row(tmp_path, capsys, predictions, needles):
    kv = tmp_path / "kv"
    write_kvpress_dir(kv, "a", KVPRESS_CONFIG, {"niah_multivalue": {"string_match": 75.0},
                                                "qa_1": {"string_match": 50.0}}, predictions)
    fails(capsys, ["import", str(kv), "--out_dir", str(tmp_path / "o")], *needles)
    assert not (tmp_path / "o").exists()


def test_export_refuses_a_run_of_another_task_and_a_token_budget(tiny_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "ruler.jsonl", ruler_rows())
    cli.main(["--tasks", "kvpress_dataset", "--protocol", "kvpress", "--dataset", str(data), "--checkpoint_path",
              str(tiny_dir), "--cache_strategy", "recent_global", "--max_cache_length", "40", "--no-baseline",
              "--out_dir", str(tmp_path / "out"), "--limit", "1"])
    (run,) = [p.parent for p in (tmp_path / "out").glob("*/*/*/metrics.json")]
    capsys.readouterr()
    fails(capsys, ["export", str(run), "--to", str(tmp_path / "kv")], "--max_cache_length [40.0]")
    assert not (tmp_path / "kv").exists()


@pytest.mark.parametrize("damage, needle", [
    (lambda run: (run / "items.jsonl").write_text("".join((run / "items.jsonl").read_text().splitlines(True)[:-1])),
     "items.jsonl holds 5 items, metrics.json counts 6"),
    (lambda run: (run / "predictions.jsonl").write_text('{"index": 0'), "predictions.jsonl line 1"),
    (lambda run: (run / "metrics.json").write_text("[]"), "metrics.json: not a JSON object"),
], ids=["items cut at a line", "predictions cut", "metrics not an object"])
def test_export_refuses_a_damaged_run(tiny_dir, tmp_path, capsys, damage, needle):
    _, dirs = run_ours(tiny_dir, tmp_path)
    damage(dirs["recent_global"])
    capsys.readouterr()
    fails(capsys, ["export", str(dirs["recent_global"]), "--to", str(tmp_path / "kv")],
          f"{dirs['recent_global']} is damaged ({needle}")
    assert not (tmp_path / "kv").exists()


def test_longbench_rows_export_one_kvpress_directory_per_task(tiny_dir, tmp_path):
    rows = [{"context": "Question: What is a dog? Type: animal\n" * 3, "question": "What is a cat?",
             "answer_prefix": "Type:", "answers": ["animal"], "all_classes": ["animal", "plant"], "task": "trec",
             "max_new_tokens": 3},
            {"context": "Paragraph 1: cats. Paragraph 2: dogs. " * 4, "question": "How many paragraphs?",
             "answer_prefix": "The final answer is: ", "answers": ["2"], "all_classes": None,
             "task": "passage_count", "max_new_tokens": 2}]
    data = write_jsonl(tmp_path / "longbench.jsonl", rows)
    out = tmp_path / "out"
    kvpress_runs.main(["run", "--compression_ratio", "0.75", "--dataset", str(data), "--checkpoint_path",
                       str(tiny_dir), "--cache_strategy", "l2", "--out_dir", str(out), "--no-baseline"])
    (run,) = [p.parent for p in out.glob("*/*/*/metrics.json")]
    ours = json.loads((run / "metrics.json").read_text())
    preds = {p["task"]: p for p in map(json.loads, (run / "predictions.jsonl").read_text().splitlines())}
    # kvpress's count_score and classification_score, retyped, on kvpress's lstripped prediction.
    numbers = re.findall(r"\d+", preds["passage_count"]["prediction"].lstrip())
    count = sum(n == "2" for n in numbers) / len(numbers) if numbers else 0.0
    first = preds["trec"]["prediction"].lstrip().split("\n")[0]
    matched = [c for c in ("animal", "plant") if c in first]
    trec = 1.0 / len(matched) if "animal" in matched else 0.0
    assert ours["score_passage_count"] == round(count * 100, 2) and ours["score_trec"] == round(trec * 100, 2)
    kvpress_runs.main(["export", str(run), "--to", str(tmp_path / "kv"), "--model", "org/tiny"])
    names = sorted(p.name for p in (tmp_path / "kv").iterdir())
    assert names == ["longbench__passage_count__org--tiny__l2__0.75", "longbench__trec__org--tiny__l2__0.75"]
    for name, task in zip(names, ("passage_count", "trec"), strict=True):
        assert json.loads((tmp_path / "kv" / name / "metrics.json").read_text()) == ours[f"score_{task}"]
        assert "answers" in pd.read_csv(tmp_path / "kv" / name / "predictions.csv")
    # trec's classes travel with its predictions, so the import rescores it (they were dropped once: the import
    # then refused the exported directory).
    back = tmp_path / "back"
    kvpress_runs.main(["import", str(tmp_path / "kv"), "--out_dir", str(back)])
    table = read_results(back / "results.csv").set_index("imported_from")
    assert table.loc[names[1], "score_trec_rescored"] == ours["score_trec"]
    assert table.loc[names[0], "score_passage_count_rescored"] == ours["score_passage_count"]


def hub_offline(monkeypatch, cache: Path) -> None:
    """The hub offline and `cache` (empty: nothing to fall back on) the datasets cache, as the variables set
    before the process starts make them. `datasets` and `huggingface_hub` read the variables once, at import:
    where an earlier test of this worker imported them online, load_dataset would retry the unreachable hub
    for ~25 s before failing."""
    import datasets.config
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setattr(datasets.config, name, True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)


def test_a_hub_dataset_offline_fails_in_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    hub_offline(monkeypatch, tmp_path / "hf")
    out = tmp_path / "out"
    fails(capsys, ["run", "--compression_ratio", "0.5", "--dataset", "simonjegou/ruler", "--dataset_config", "4096",
                   "--checkpoint_path", str(tiny_dir), "--cache_strategy", "l2", "--out_dir", str(out),
                   "--no-baseline"], "cannot load dataset 'simonjegou/ruler'", after_progress=True)
    assert not list(out.glob("*/*/*/metrics.json"))


def test_a_later_task_groups_bad_row_is_refused_before_any_run(tiny_dir, tmp_path):
    """kvpress_dataset answers its rows task by task: a qa_1 row past the model's context is refused before the
    first group (niah_single_1) runs, for the baseline and the strategy alike (eval checks every run's inputs
    first), and nothing is written."""
    rows = [*ruler_rows(), {"context": FILLER * 40, "question": "Where is Paris?", "answer_prefix": "Answer:",
                            "answer": ["France"], "task": "qa_1", "max_new_tokens": 3}]
    data = write_jsonl(tmp_path / "ruler.jsonl", rows)
    with pytest.raises(UserError, match="kvpress_dataset: prompts of .* exceed the model's context of 1024"):
        cli.main(["--tasks", "kvpress_dataset", "--protocol", "kvpress", "--dataset", str(data), "--checkpoint_path",
                  str(tiny_dir), "--cache_strategy", "recent_global", "--max_cache_length", "0.5",
                  "--out_dir", str(tmp_path / "out")])
    assert list((tmp_path / "out").rglob("*/*")) == []
