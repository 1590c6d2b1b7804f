"""What a model must be for the engine to train it: an embedding, N identical blocks and a head
(``layered``), and the residuals a block may keep from its forward to its backward (``remat``).

Models import only this package; it never imports the engine (``pyproject.toml``'s import contracts)."""
