"""Pure weight functions: (samples, policy, now) -> weights. No clocks, no I/O."""
