"""Where the tests find ../shared/data (the tiny model and eval data); never copied into the repo."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# ../shared/data beside the checkout; the device scripts point this at a carried copy.
SHARED = Path(os.environ.get("QUANTGATE_SHARED_DATA", REPO.parent / "shared" / "data"))
TINY_MODEL = SHARED / "models" / "stories260k-i256"
