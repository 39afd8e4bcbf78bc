"""Resolve a model argument to a local folder: a path as is, a hub id through huggingface_hub,
a .gguf file through its cached checkpoint view (model_loader/gguf.py).

Hub ids go through `snapshot_download`, which answers from the local cache when
`HF_HUB_OFFLINE=1` (or when the network is unreachable and the files are cached). Nothing here runs
at import time.
"""

from __future__ import annotations

import os
from pathlib import Path

_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def resolve_model_path(model: str, revision: str | None = None, what: str = "model") -> str:
    """Local folder holding the checkpoint named by `model` (`what` names the argument in
    errors: "model", "tokenizer", "speculative_config.model").

    A `.gguf` file resolves to its checkpoint view (config, tokenizer and generation config
    derived from the file's metadata, plus a pointer to the file for the weights).

    Raises:
        FileNotFoundError: for a path that does not exist, or a hub id that is neither cached nor
            downloadable, naming it.
        ValueError: a .gguf file that is invalid or of an unsupported architecture or tensor
            type, naming it.
    """
    if os.path.isdir(model):
        return str(Path(model).resolve())
    from pagedllm.model_loader.gguf import is_gguf_path, prepare_gguf_view
    if is_gguf_path(model):
        return prepare_gguf_view(model)
    # Hub ids are "name" or "org/name"; anything else can only be a (missing) local path.
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or os.path.exists(model):
        raise FileNotFoundError(f"{what} folder not found: {model}")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(model, revision=revision, allow_patterns=_ALLOW_PATTERNS)
    except Exception as e:  # the hub client raises many error types (offline, 404, auth)
        raise FileNotFoundError(
            f"{what} {model!r} is not a local folder and could not be resolved on the Hugging Face "
            f"hub or its cache ({type(e).__name__}: {e}). Set HF_HUB_OFFLINE=1 to use cached "
            "files only.") from e
