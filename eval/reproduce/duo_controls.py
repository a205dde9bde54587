"""Head-role files for DuoAttention's controls (the `duoattention` experiment), derived from the shipped
calibration in calibrate_duo.py's format, so that a control changes which heads retrieve and nothing else.

- inverse: the shipped scores negated, so the heads a streaming pattern hurts least become retrieval heads;
- random: a score drawn uniformly per head with a fixed seed, so the retrieval heads are a random subset of
  the same size (strategies/duo_attention.retrieval_heads keeps the top fraction of any scores).

The calibration is the model's own: the shipped file for the bundled model, duo/<checkpoint name>.json
(calibrate_duo.py's default output) for another one; a copy of it is the treatment arm's head file, so that
no arm falls back to the strategy's default (the shipped file, which fits the bundled model only).
The files go to the temp directory (the strategy reads --duo_heads_path; its shipped file stays untouched);
a run's identity hashes their content (eval/results.py), so a changed calibration is never mistaken for an
old run.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from atomic_files import write_json_atomic
from errors import UserError
from strategies.duo_attention import DUO_DIR, SHIPPED, load_head_scores
from train_gates import model_name

CONTROL_DIR = Path(tempfile.gettempdir()) / "eval-reproduce-duo"
RANDOM_SEED = 0
RANDOM_PATH = CONTROL_DIR / f"random_seed{RANDOM_SEED}.json"
INVERSE_PATH = CONTROL_DIR / "inverse.json"
CALIBRATED_PATH = CONTROL_DIR / "calibrated.json"


def calibration_for(checkpoint_path: str | None) -> Path:
    """The calibration the arms derive from: the shipped file for the bundled model, else calibrate_duo.py's
    default output for `checkpoint_path`, which must exist (refused before anything runs)."""
    if checkpoint_path is None:
        return SHIPPED
    path = DUO_DIR / f"{model_name(checkpoint_path)[0]}.json"
    if not path.is_file():
        raise UserError(f"no DuoAttention calibration for {checkpoint_path}: {path} is missing; write it with "
                        f"python calibrate_duo.py --checkpoint_path {checkpoint_path}")
    return path


def inverse_scores(scores: list[list[float]]) -> list[list[float]]:
    """Negated scores: the ranking reversed (ties keep retrieval_heads' earlier-head order)."""
    return [[-s for s in layer] for layer in scores]


def random_scores(scores: list[list[float]], seed: int) -> list[list[float]]:
    """One uniform draw per head, in (layer, head) order, from `seed`: the same shape as `scores`."""
    rng = random.Random(seed)
    return [[rng.random() for _ in layer] for layer in scores]


def control_file(calibration: dict, scores: list[list[float]], measure: str) -> dict:
    return {**calibration, "measure": measure, "scores": scores}


def write_control_files(source: Path = SHIPPED, out_dir: Path = CONTROL_DIR) -> list[Path]:
    """Write the inverse and random head-role files of `source`, and a copy of it (the treatment's), into
    `out_dir` (replaced each time)."""
    calibration = load_head_scores(source)
    scores = calibration["scores"]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, derived, measure in (
            (CALIBRATED_PATH.name, scores, calibration["measure"]),
            (INVERSE_PATH.name, inverse_scores(scores), f"negated scores of {source.name} (inverse ranking)"),
            (RANDOM_PATH.name, random_scores(scores, RANDOM_SEED),
             f"uniform random scores, seed {RANDOM_SEED} (random roles; the shape of {source.name})")):
        path = out_dir / name
        write_json_atomic(path, control_file(calibration, derived, measure), overwrite=True)
        written.append(path)
    return written
