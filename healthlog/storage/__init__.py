"""Storage: the journal and projection SQLite files. Only this package speaks SQLite."""
