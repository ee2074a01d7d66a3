"""The RL step's stages: sampling, scoring, the typed batch, corrections, advantages, the weight sync."""
