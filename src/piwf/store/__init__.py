"""All SQL lives in this package; the rest of piwf calls its named functions."""

from piwf.store.db import Database

__all__ = ["Database"]
