"""Programs the ranks run: the RL loop, SFT, and the distributed smoke job."""
