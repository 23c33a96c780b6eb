"""The learned policy as served: its scorer, inputs, admission order, sampler and POLICY_DIR bundle."""
