"""Console scripts (see pyproject's [project.scripts]); each module's `main(argv) -> exit code`."""
