"""Skills: prompt building and per-request decode state machines (query, caption, point, detect, segment)."""
