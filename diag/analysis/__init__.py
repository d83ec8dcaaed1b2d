"""The analysis layer: findings from numbers; the compare pipeline."""
