"""SFT: fine-tune the policy on trajectories with tool results masked (entry: sft.run)."""
