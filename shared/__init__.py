"""The library every job imports: config, cluster, data, models, parallel, loop, checkpoint,
metrics. ``shared.parallel`` and ``shared.loop`` never import Ray, so they also run under
plain ``torchrun``."""
