"""Offline learning from logged telemetry: decisions, rewards, the learner and off-policy estimates."""
