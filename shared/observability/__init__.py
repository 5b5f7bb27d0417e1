"""What a run tells you: step metrics and the progress line (``metrics``), TensorBoard events
(``tensorboard_log``), the loss-curve PNG (``plots``), profiler trace ranges (``profiling``),
start-up phases (``startup``), quiet logs (``log_filter``) and live stacks (``stack``)."""
