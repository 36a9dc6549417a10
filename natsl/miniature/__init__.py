"""The paper in miniature (issue 54): the evaluation stage and the report of `natsl miniature`."""
