"""The paper in miniature as one resumable pipeline (`natsl miniature`, docs/miniature.md): the stages (pipeline),
the evaluations (evaluate, lm_task) and the report (report)."""
