"""The served model names (one rule for every server) and the GET /v1/models answer.

The rule is vLLM's: the names given with `--served-model-name` (several may be given; a request
may use any of them, the first is the one reported back), otherwise the `--model` argument exactly
as the user passed it (a path stays that path, relative or absolute; a hub id stays that id), and
`shakespeare-10m` when `--model` is omitted and the shipped model is served. A request naming
another model gets 404 `model_not_found`; a request without `model` uses the first name.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList


def resolve_served_model_names(model: str | None,
                               served_model_name: Sequence[str] | None = None) -> list[str]:
    """The names clients use for the served model (see the module docstring for the rule).

    Args:
        model: the `--model` argument as given; None when it was omitted (the shipped model).
        served_model_name: the `--served-model-name` values, if any.

    Returns:
        The names, first one reported back in responses; duplicates dropped, order kept.

    Raises:
        ValueError: an empty or blank name.
    """
    if served_model_name:
        names = list(dict.fromkeys(served_model_name))
    elif model is not None:
        names = [model]
    else:
        from pagedllm.assets import DEFAULT_MODEL_NAME
        names = [DEFAULT_MODEL_NAME]
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"served model names must be non-empty strings, got {name!r}")
    return names


def model_list(served_model_names: Sequence[str], root: str | None,
               max_model_len: int) -> ModelList:
    """GET /v1/models: one card per served name, each with `root` (the checkpoint the server
    loaded) and `max_model_len` (context length in tokens), as vLLM lists them."""
    return ModelList(data=[ModelCard(id=name, root=root, max_model_len=max_model_len)
                           for name in served_model_names])
