"""RULER's 13 tasks by RULER's names (arXiv 2404.06654; NVIDIA/RULER `scripts/synthetic.yaml`), generated
locally at any `--seq_len`, and scored with RULER's own scorer (eval/scorers.py): string_match_all, or
string_match_part for qa_1 / qa_2, in [0, 1] as `string_match`.

- niah_*: one generator following RULER's niah.py: its needle, its template (singular when one value is
  asked for), keys / values of its types (words: two words joined by "-", as RULER's adjective-noun
  pairs, from eval/data/words.txt; numbers: 7 digits; uuids: uuid4), haystacks `repeat` (RULER's noise
  sentences), `essay` (RULER uses Paul Graham's essays, not shipped: `--haystack` stands in, pydoc by
  default, any text file) and `needle` (the haystack itself made of distracting needles), and the number
  of keys, values per key and keys asked for of each task in synthetic.yaml.
- vt, cwe, fwe: the existing variable_tracking (1 chain, 4 hops), common_words_extraction (10 words, 30 /
  3 occurrences from 4k tokens on) and frequent_words_extraction (Zipf exponent 2) generators, which
  carry RULER's parameters; their instructions are worded slightly differently from RULER's templates.
- qa_1 (SQuAD) / qa_2 (HotpotQA): rows of a local `--dataset` with `question`, `answers` (or `answer`) and
  `context` (SQuAD: one paragraph; HotpotQA: a list of paragraphs, each "title\\ntext"); the gold
  paragraphs and as many distracting paragraphs of other rows as fit, shuffled, as RULER's qa.py
  (which also prefers SQuAD paragraphs of the same article as distractors: the rows here have no article).

`python -m eval.kvpress_runs ruler_file` writes these tasks' items as a file in kvpress's layout (the
context, question, answer_prefix split kvpress's create_huggingface_dataset makes) for kvpress_dataset.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from pathlib import Path

from errors import CliParser, UserError
from eval.data import NOISE_SENTENCES, haystack, load_rows, word_list
from eval.harness import Runtime
from eval.scorers import ruler_item_score
from eval.tasks.base import Example, SyntheticTask, encode_example, fit_to_length, register_task, use_chat
from eval.tasks.variable_tracking import VariableTracking
from eval.tasks.words import CommonWordsExtraction, FrequentWordsExtraction

NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will "
            "quiz you about the {type_v} afterwards.\n{context}\nWhat are all the special magic {type_v} for "
            "{query} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.round(np.linspace(0, 100, 40)): where essay needles go
# kvpress's MAX_NEW_TOKENS (RULER's tokens_to_generate), per family.
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
QA_TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output any "
               "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
               "the given documents. Only give me the answer and do not output any other words.\n\n")


class RulerScored(SyntheticTask):
    def score(self, prediction: str, example: Example) -> dict[str, float]:
        return {"string_match": ruler_item_score(self.name, prediction, example.answers)}


def random_of(kind: str, rng: random.Random, words: list[str]) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(words)}-{rng.choice(words)}"


class RulerNeedle(RulerScored):
    """synthetic.yaml's niah arguments; num_needle_k is raised to num_needle_q, as niah.py does."""

    type_haystack, type_k, type_v = "essay", "words", "numbers"
    num_k, num_v, num_q = 1, 1, 1
    reads = SyntheticTask.reads
    defaults = {**SyntheticTask.defaults, "max_new_tokens": MAX_NEW_TOKENS["niah"]}

    def builder(self, rng: random.Random) -> Callable[[int], Example]:
        words = word_list()
        n_keys = max(self.num_k, self.num_q)
        keys = [random_of(self.type_k, rng, words) for _ in range(n_keys)]
        values = [[random_of(self.type_v, rng, words) for _ in range(self.num_v)] for _ in keys]
        needles = [NEEDLE.format(type_v=self.type_v, key=k, value=v) for k, vs in zip(keys, values, strict=True)
                   for v in vs]
        rng.shuffle(needles)
        asked = rng.sample(range(n_keys), self.num_q)
        answers = [v for i in asked for v in values[i]]
        queries = [keys[i] for i in asked]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        template, prefix, type_v = TEMPLATE, ANSWER_PREFIX, self.type_v
        if self.num_q * self.num_v == 1:  # niah.py's singular wording, replaced in the template itself
            for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template, prefix = template.replace(old, new), prefix.replace(old, new)
            type_v = type_v[:-1]
        units, joiner, where = self._haystack_units(rng, words)
        intro, question = template.split("{context}")

        start = rng.randrange(len(units))

        def build(n: int) -> Example:
            sentences = [units[(start + j) % len(units)] for j in range(n)]
            for position, needle in sorted(zip(where(n), needles, strict=True), reverse=True):
                sentences.insert(position, needle)
            context = intro.format(type_v=type_v) + joiner.join(sentences)
            return Example(context, question.format(type_v=type_v, query=query),
                           prefix.format(type_v=type_v, query=query), answers=answers, meta={"query": query})

        return build

    def _haystack_units(self, rng: random.Random, words: list[str]):
        """(units, joiner, positions of the needles for n units) of this task's haystack."""
        n_needles = max(self.num_k, self.num_q) * self.num_v
        if self.type_haystack == "essay":
            if not hasattr(self, "_essay"):
                self._essay = haystack(self.options["haystack"])
            units, joiner = self._essay
            depths = sorted(rng.sample(DEPTHS, n_needles))
            return units, joiner, lambda n: [int(n * d / 100) for d in depths]
        if self.type_haystack == "repeat":
            units = [NOISE_SENTENCES]
        else:  # "needle": distracting needles, drawn once in order so build(n) is deterministic
            units = [NEEDLE.format(type_v=self.type_v, key=random_of(self.type_k, rng, words),
                                   value=random_of(self.type_v, rng, words)) for _ in range(4096)]
        seed = rng.random()

        def where(n: int) -> list[int]:  # niah.py: distinct random places among the haystack's sentences
            draw = random.Random(seed)
            return sorted(draw.sample(range(n + 1), n_needles) if n + 1 >= n_needles else
                          draw.choices(range(n + 1), k=n_needles))

        return units, "\n", where


# RULER's name -> its generator here. niah_multivalue is also the name of eval/tasks/niah.py's task (RULER's
# structure: one key, four values, words and numbers; its own wording): `--tasks niah_multivalue` runs that
# one, ruler_file writes this one.
GENERATORS: dict[str, type[SyntheticTask]] = {}


def _needle(name: str, **settings: object) -> type:
    cls = type(name, (RulerNeedle,), {"name": name, **settings})
    GENERATORS[name] = cls
    return cls if name == "niah_multivalue" else register_task(cls)


_needle("niah_single_1", type_haystack="repeat")
_needle("niah_single_2")
_needle("niah_single_3", type_v="uuids")
_needle("niah_multikey_1", num_k=4)
_needle("niah_multikey_2", type_haystack="needle")
_needle("niah_multikey_3", type_haystack="needle", type_k="uuids", type_v="uuids")
_needle("niah_multivalue", num_v=4)
_needle("niah_multiquery", num_q=4)


@register_task
class RulerVT(RulerScored, VariableTracking):
    name = "vt"
    defaults = {**VariableTracking.defaults, "max_new_tokens": MAX_NEW_TOKENS["vt"]}


@register_task
class RulerCWE(RulerScored, CommonWordsExtraction):
    name = "cwe"
    defaults = {**CommonWordsExtraction.defaults, "max_new_tokens": MAX_NEW_TOKENS["cwe"]}


@register_task
class RulerFWE(RulerScored, FrequentWordsExtraction):
    name = "fwe"
    defaults = {**FrequentWordsExtraction.defaults, "max_new_tokens": MAX_NEW_TOKENS["fwe"]}


class RulerQA(RulerScored):
    reads = tuple(r for r in SyntheticTask.reads if r != "haystack") + ("dataset", "dataset_config", "split")
    defaults = {**SyntheticTask.defaults, "max_new_tokens": MAX_NEW_TOKENS["qa"], "split": "train"}
    required = ("dataset",)
    required_note = ": a local file with question, answers and context"

    def _questions(self) -> tuple[list[tuple[str, list[str], list[str]]], list[str]]:
        """(question, answers, gold paragraphs) per row, and every paragraph (sorted, as qa.py's pool)."""
        from eval.tasks.kvpress_datasets import _string_list

        o = self.options
        rows = load_rows(o["dataset"], o["dataset_config"], o["split"])
        answer = "answers" if "answers" in rows[0] else "answer"
        missing = [c for c in ("question", answer, "context") if c not in rows[0]]
        if missing:
            raise UserError(f"{o['dataset']}: no column {', '.join(map(repr, missing))} ({self.name} needs "
                            f"question, answers and context); its columns: {', '.join(rows[0])}")
        out = []
        for i, row in enumerate(rows):
            where = f"{o['dataset']} row {i}, column"
            question = _string_list(row["question"], f"{where} 'question'", "the question")[0]
            out.append((question, _string_list(row[answer], f"{where} {answer!r}", "the references"),
                        _string_list(row["context"], f"{where} 'context'", "the paragraphs")))
        return out, sorted({p for *_, gold in out for p in gold})

    def builder(self, rng: random.Random) -> Callable[[int], Example]:
        if not hasattr(self, "_pool"):
            self._rows, self._pool = self._questions()
        question, answers, gold = self._rows[rng.randrange(len(self._rows))]
        others = [p for p in self._pool if p not in gold]
        order = rng.sample(others, len(others))
        shuffle_seed = rng.random()

        def build(n: int) -> Example:
            docs = gold + order[:n]
            random.Random(shuffle_seed).shuffle(docs)
            context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
            return Example(QA_TEMPLATE.format(context=context), f"Question: {question}", " Answer:", answers=answers)

        return build

    def examples(self, rt: Runtime) -> list[Example]:
        if not hasattr(self, "_pool"):
            self._rows, self._pool = self._questions()
        most = len(self._pool)
        chat = use_chat(rt)
        return [fit_to_length(self.builder(random.Random(f"{self.name}:{self.args.seed}:{i}")),
                              lambda ex: len(encode_example(rt.tokenizer, ex, chat)[0]), self.options["seq_len"],
                              most, self.name) for i in range(self.options["limit"])]


for _cls in (RulerVT, RulerCWE, RulerFWE, register_task(type("qa_1", (RulerQA,), {"name": "qa_1"})),
             register_task(type("qa_2", (RulerQA,), {"name": "qa_2"}))):
    GENERATORS[_cls.name] = _cls
RULER_TASKS = tuple(GENERATORS)


# ---- a kvpress-layout file from these generators -----------------------------------------------------------


def kvpress_row(task: str, example: Example, n_tokens: int) -> dict:
    """An item as kvpress's create_huggingface_dataset splits RULER's input: the answer prefix starts at
    its first word (its leading whitespace ends the question)."""
    prefix = example.answer_prefix.lstrip()
    question = example.question.lstrip()
    context = example.context + example.question[: len(example.question) - len(question)]
    question += example.answer_prefix[: len(example.answer_prefix) - len(prefix)]
    return {"context": context, "question": question, "answer_prefix": prefix, "answer": example.answers,
            "task": task, "max_new_tokens": MAX_NEW_TOKENS[task.split("_")[0] if task.startswith(("niah", "qa"))
                                                           else task], "length": n_tokens}


# What ruler_file reads of eval's flags besides the task flags: the items come from the tasks and --seed, their
# token counts from the model's tokenizer (and chat template).
RULER_FILE_READS = {"tasks", "seed", "checkpoint_path", "device", "dtype", "allow_non_finite_weights"}


def check_ruler_file_flags(tasks: list[str], argv: list[str]) -> None:
    """ruler_file writes items and runs no cache: a flag typed that it would ignore (a cache or run flag, or a
    task flag none of `tasks` reads) is refused, as python -m eval refuses its own ignored flags."""
    from eval import cli
    from flag_types import explicit_dests

    parser = cli.build_parser()
    typed = explicit_dests(parser, argv)
    cli.check_task_flags_read(tasks, typed, parser)
    ignored = sorted(typed - RULER_FILE_READS - set(cli.task_flags(parser)))
    if ignored:
        raise UserError(f"--{ignored[0]} would be ignored: ruler_file writes the items and runs no cache")


def ruler_file_main(argv: list[str]) -> Path:
    """python -m eval.kvpress_runs ruler_file --tasks T... --to FILE [python -m eval's task and model flags]."""
    import pandas as pd

    from atomic_files import atomic_target
    from eval import cli

    parser = CliParser(prog="python -m eval.kvpress_runs ruler_file", allow_abbrev=False)
    parser.add_argument("--to", type=Path, required=True, help="a .jsonl, .csv or .parquet file")
    parser.add_argument("--overwrite", action="store_true")
    known, rest = parser.parse_known_args(argv)
    if known.to.suffix not in (".jsonl", ".csv", ".parquet"):
        raise UserError(f"--to {known.to}: write a .jsonl, .csv or .parquet file")
    args = cli.parse_args(rest)
    unknown = [t for t in args.tasks if t not in RULER_TASKS]
    if unknown:
        raise UserError(f"ruler_file writes RULER's tasks ({', '.join(RULER_TASKS)}), not {', '.join(unknown)}")
    check_ruler_file_flags(args.tasks, rest)
    rt = Runtime(*cli.model_of(args), args)
    chat = use_chat(rt)
    rows = []
    for name in args.tasks:
        task = GENERATORS[name](args)
        for ex in task.examples(rt):
            rows.append(kvpress_row(name, ex, len(encode_example(rt.tokenizer, ex, chat)[0])))
    with atomic_target(known.to, known.overwrite) as tmp:
        if known.to.suffix == ".jsonl":
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        elif known.to.suffix == ".csv":
            pd.DataFrame(rows).assign(answer=[json.dumps(r["answer"]) for r in rows]).to_csv(tmp, index=False)
        else:
            pd.DataFrame(rows).to_parquet(tmp, index=False)
    print(known.to)
    return known.to
