"""Observability: what a run publishes and where it goes.

Owns: the metric channel through which trainers and hooks publish and read
scalars (:mod:`.metrics`: :class:`~pimm.engines.observe.metrics.MetricChannel`),
its sinks (``metrics.jsonl``, TensorBoard, W&B: :mod:`.writers`), the W&B
run's options (:mod:`.wandb_options`) and structured step tracing under
``save_path/trace/`` (:mod:`.tracing`).

Public surface: ``MetricChannel``, ``MetricsWriter``, ``Tracer`` and the
``trace_span`` helpers. A new sink is added in :mod:`.writers`.

This ``__init__`` imports nothing: each module is imported by its own path.
"""
