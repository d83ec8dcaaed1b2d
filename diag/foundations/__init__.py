"""The foundations layer: no domain knowledge (errors, files, JSON numbers, versions, progress)."""
