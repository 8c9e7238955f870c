"""What runs and builds the course around the notebooks: `make run` (harness), labs/ and exports (labs), the
parameter table, the report, the executed GPU copies, the pre-flight check. No notebook imports it."""
