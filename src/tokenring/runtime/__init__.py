"""What runs a schedule: the communicator (``comm``, the one door to ``torch.distributed``),
the block kernels (``kernels``), the ring executor (``ring``), the collective executor
(``collective``) and the autograd operator that joins them (``op``)."""
