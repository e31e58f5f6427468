"""The control loop: the tick, weights, rollouts, autoscaling, discovery, leader election."""
