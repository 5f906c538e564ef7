"""Profile from a notebook (the capture and the reading of its trace, in capture.py until they split)."""

from .capture import Profile, ProfileSummary, profile, read_trace, trace_stats  # noqa: F401
