"""The child-process side of a run: ``python -m piwf.worker``."""
