"""The pre-flight memory planner's pieces: model shapes from config.json, per-rank parameter counts,
activation sizes, and the per-rank plan (``python -m services.trainer.plan`` is the command line)."""
