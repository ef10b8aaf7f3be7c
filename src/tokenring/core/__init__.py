"""The vocabulary every layer shares: ``layout``, ``masks``, ``merge`` and ``schedule``."""
