"""Input: where a job's rows live, the readers of each format, and each row parsed into a Job."""
