"""Evaluation: records, metrics, datasets, calibration, diagnostics and reports.

May import: the package's face and shared vocabulary (the top-level modules), `target`,
`drafting` and `decoding`; not `training` (the two sit side by side).
"""
