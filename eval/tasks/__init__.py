"""The task registry: each task is a small module that registers its classes with `register_task`.

    fidelity                   teacher forcing over a long text: KL(full ‖ compressed), top-1, perplexity
    niah_single / niah_multikey / niah_multivalue    RULER needle retrieval
    variable_tracking          RULER multi-hop tracing
    common_words_extraction / frequent_words_extraction    RULER aggregation
    qa / multiple_choice       rows of a local file (or hub dataset) through `datasets`
    niah_single_1 ... qa_2     RULER's 13 tasks by RULER's names (RULER's scorer)
    kvpress_dataset            rows in kvpress's layout (its RULER / LongBench copies), scored per task

A new task: subclass `Task` (or `GenerationTask` / `SyntheticTask`), decorate it with `register_task`,
and import its module here.
"""

from eval.tasks import dataset, fidelity, niah, variable_tracking, words  # noqa: F401  (registers the tasks)
from eval.tasks import kvpress_datasets as kvpress_datasets  # noqa: F401  (registers kvpress_dataset)
from eval.tasks import reasoning as reasoning  # noqa: F401  (registers math)
from eval.tasks import ruler as ruler  # noqa: F401  (registers RULER's 13 tasks by RULER's names)
from eval.tasks.base import TASKS, Example, Task, TaskResult, get_task, register_task

__all__ = ["TASKS", "Example", "Task", "TaskResult", "get_task", "register_task"]
