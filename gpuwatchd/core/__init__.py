"""The plain data and names every layer shares: the model, the vocabulary, checked reads,
escaping, paths."""
