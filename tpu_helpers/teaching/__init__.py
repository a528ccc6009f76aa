"""What the notebooks teach with: exercise checks, the offline fixtures and parameters,
the report and its plots."""
