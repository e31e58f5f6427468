"""Canary rollouts: the pure state machine, where its state lives, and the runner."""
