"""The fix layer: recipes, quantizing, searching, timing, scale-out."""
