"""Drafter training: data generation, losses, the training mask and the trainer."""
