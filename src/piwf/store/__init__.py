"""All SQL lives in this package; the rest of piwf calls its named functions."""

from .db import Database

__all__ = ["Database"]
