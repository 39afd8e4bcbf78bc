"""Package logger: INFO to stderr with a short prefix, unless the application configured logging."""

from __future__ import annotations

import logging

from pagedllm import envs


def init_logger() -> None:
    logger = logging.getLogger("pagedllm")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s",
                                           "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(envs.get("PAGEDLLM_LOGGING_LEVEL"))
    logger.propagate = False
