"""Logging: the package's records come from rank 0 only. Every module takes its logger from
:func:`get_logger`.

A filter on a logger does not apply to its children's records, so each module logger gets it."""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["RankZeroFilter", "get_logger"]


class RankZeroFilter(logging.Filter):
    """Passes records on global rank 0 (torch.distributed's rank once initialized, else $RANK, else
    0)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _rank() == 0


def _rank() -> int:
    distributed = getattr(sys.modules.get("torch"), "distributed", None)
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_rank())
    return int(os.environ.get("RANK", "0"))


_FILTER = RankZeroFilter()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` whose records pass on rank 0 only."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
