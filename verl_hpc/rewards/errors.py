"""The reward layer's exception: a reward that cannot be computed names the sample and the fix."""


class RewardError(ValueError):
    """Unknown data_source, refused custom code, a raising reward function under on_error=raise, ..."""
