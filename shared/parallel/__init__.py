"""One module per parallelism strategy. Pure torch (no Ray), so each also runs under torchrun.

Each exposes an ``apply_*`` function that turns a plain model into its distributed form, and
a :class:`~shared.parallel.base.Strategy` that the shared loop drives.
"""
