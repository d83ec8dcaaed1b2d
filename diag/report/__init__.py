"""The report layer: documents, views, plots, gates."""
