"""How parts are updated: the per-step decision (``policy``), the host optimizer and its C++ kernel
(``host_optimizer``, ``host_kernel``), the worker thread that runs host updates in order (``worker``),
GPU-resident parts (``resident``) and Adam moments on disk (``disk_tier``)."""
