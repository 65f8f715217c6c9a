"""Drafter training: data generation, sharded data, the feature cache (bounded or not), losses,
the training mask, resuming and the trainer.

May import: the package's face and shared vocabulary (the top-level modules), `target`,
`drafting` and `decoding`; not `eval` (the two sit side by side).
"""
