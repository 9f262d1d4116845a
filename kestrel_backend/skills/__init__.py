"""Skills: the table of skills (catalog.py), prompt building and per-request decode state machines."""
