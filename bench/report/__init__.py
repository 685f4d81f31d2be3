"""The report: results files read back, charts and REPORT.md drawn from those CSVs alone."""
