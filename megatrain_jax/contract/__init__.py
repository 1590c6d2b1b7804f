"""What a model must be for the engine to train it: an embedding, N blocks (of one kind or a few) and a head
(``layered``), and the residuals a block may keep from its forward to its backward (``remat``).

Models import only this package; it never imports the engine (``pyproject.toml``'s import contracts)."""
