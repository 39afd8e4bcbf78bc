"""Whether a model has a chat template, found before its weights load.

`chat` and `generate --chat` cannot work without one, and `serve` then answers every chat request
with an error; loading a large model first only to find that out costs a minute. The template's
presence is read from the files that hold it: a checkpoint folder's `tokenizer_config.json` /
`chat_template.jinja` / `chat_template.json`, or a GGUF file's `tokenizer.chat_template`
metadata key (`model_loader/gguf_metadata.py`: the key/value section only, no tensor, in well
under a second also for a 262k-token vocabulary). Hub ids are not looked up
(None: unknown; the engine's own check after loading then speaks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

GGUF_CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def has_chat_template(model: str, tokenizer: str | None = None,
                      chat_template: str | None = None) -> bool | None:
    """Whether the tokenizer the engine will use has a chat template.

    Args:
        model: checkpoint folder, hub id or .gguf file (as given to the engine).
        tokenizer: the --tokenizer folder or hub id, if any (it decides over the model's).
        chat_template: the --chat-template value, if any (then the answer is True).

    Returns:
        True or False where the files say; None for a hub id or a path that is neither a
        folder nor a .gguf file (the engine reports those itself).

    Raises:
        ValueError: a .gguf file that is not a valid GGUF file (naming it).
    """
    if chat_template is not None:
        return True
    source = tokenizer or model
    if source.lower().endswith(".gguf") and os.path.isfile(source):
        from pagedllm.model_loader.gguf_metadata import read_gguf_metadata
        return bool(read_gguf_metadata(source, {GGUF_CHAT_TEMPLATE_KEY})
                    .get(GGUF_CHAT_TEMPLATE_KEY))
    folder = Path(source).expanduser()
    if not folder.is_dir():
        return None
    if any((folder / name).is_file() for name in _TEMPLATE_FILES):
        return True
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except (OSError, ValueError):
        return None


def no_chat_template_message(model: str) -> str:
    """The one wording of "this model has no chat template" at start-up."""
    return (f"{model} has no chat template, so chat requests cannot be rendered; give one with "
            f"--chat-template FILE (a Jinja template)")


def require_chat_template(model: str, tokenizer: str | None, chat_template: str | None) -> None:
    """Refuse, before the model loads, a chat command on a model whose files show no chat
    template.

    Raises:
        ValueError: `no_chat_template_message`; nothing for a hub id (unknown here).
    """
    if has_chat_template(model, tokenizer, chat_template) is False:
        raise ValueError(no_chat_template_message(model))
