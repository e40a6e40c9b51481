"""Running the pipeline: the flush entry, fan-out, schedule, status, metrics exposition."""
