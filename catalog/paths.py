"""Where the catalog's files are: the packaged catalog, its lm-eval tasks, and the offline evaluation data."""

from __future__ import annotations

from pathlib import Path

from quantgate.catalog.settings import settings

CATALOG_DIR = Path(__file__).resolve().parent
DEFAULT_CATALOG = CATALOG_DIR / "models.yaml"
LOCAL_TASKS_DIR = CATALOG_DIR / "lm_eval_tasks"


def eval_data_root() -> Path:
    """$QUANTGATE_EVAL_DATA, else ../shared/data/eval beside the checkout (the offline eval data)."""
    env = settings().eval_data
    return env.expanduser() if env else CATALOG_DIR.parents[1] / "shared" / "data" / "eval"


def default_kl_text() -> str:
    """simple_stories.txt under the eval data root: the perplexity task's text."""
    return str(eval_data_root() / "simple_stories" / "simple_stories.txt")
