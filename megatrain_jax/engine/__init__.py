"""The streaming engine: what moves when (``schedule``), how each op runs (``passes``), how things move
(``transfer``), the per-part programs (``device_fns``), the host state (``parts``, ``host_state``), the
observers, and the update tier (``update/``). ``engine.Engine`` is the public step iterator
(``megatrain_jax.Engine``)."""
