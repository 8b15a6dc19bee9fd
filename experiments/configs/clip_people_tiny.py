"""Tiny privacy-per-person CLIP config for the tests: `clip_tiny` with simulated owners (1 to 4
pairs per person), at most K = 2 pairs of a person per batch, 6 people per batch."""

import ml_collections

from experiments.configs import clip_tiny


def get_config():
  config = clip_tiny.get_config()
  config.people = ml_collections.ConfigDict(
      dict(max_pairs=4, alpha=1.5, seed=0, max_pairs_per_user=2, expected_people_per_batch=6.0,
           mode="native"))
  config.methods = ("logit_dp", "dp_gcl")
  return config
