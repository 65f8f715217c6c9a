"""Drafter training: data generation, losses, the training mask and the trainer.

May import: the package's face and shared vocabulary (the top-level modules), `target`,
`drafting` and `decoding`; not `eval` (the two sit side by side).
"""
