"""Evaluation: records, metrics, datasets, calibration, diagnostics and reports."""
