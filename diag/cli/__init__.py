"""The cli layer: the verbs and the package's entry points."""
