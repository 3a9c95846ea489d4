"""Actors of the runtime: intake, journal, folding and lease holder (filled by the runtime issue)."""
