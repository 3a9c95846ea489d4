"""healthlog: a self-hosted, append-only home for Apple Health data."""

__version__ = "0.1.0"
