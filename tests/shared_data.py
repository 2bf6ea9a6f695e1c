"""Where the tests find ../shared/data (the tiny model and eval data); never copied into the repo."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# ../shared/data beside the checkout; the device scripts point this at a carried copy.
SHARED = Path(os.environ.get("QUANTGATE_SHARED_DATA", REPO.parent / "shared" / "data"))
TINY_MODEL = SHARED / "models" / "stories260k-i256"

# A minimal chat template (the tiny model has none): each turn "<|role|>\ncontent\n".
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def with_chat_template(folder: Path) -> Path:
    """A copy of the tiny model in `folder` whose tokenizer has CHAT_TEMPLATE, for chat-protocol tests."""
    import json
    import shutil

    shutil.copytree(TINY_MODEL, folder, copy_function=shutil.copyfile)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


def local_artifact(path: Path, sha: str):
    """A model folder as the download step describes a local source (its sha given, not hashed)."""
    from quantgate.catalog.records import ModelArtifact

    return ModelArtifact(model_id=path.name, path=str(path), source="local", revision=None, sha=sha)
