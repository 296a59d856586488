"""A module of the user's own whose globals a forward reads (tests/test_state_reads.py
monkeypatches `act` after a capture)."""
import torch


def act(x):
    return torch.relu(x)
