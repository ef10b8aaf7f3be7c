"""What prices a schedule: hardware and the cost model (``costmodel``), the event simulator
(``simulate``), the planner that picks a strategy (``planner``) and the emulated-link lab's
topologies (``netlab``)."""
