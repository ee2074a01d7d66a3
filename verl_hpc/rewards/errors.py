"""The reward layer's exception: a reward that cannot be computed names the sample and the fix."""
from verl_hpc.errors import VerlHpcError


class RewardError(VerlHpcError, ValueError):
    """Unknown data_source, refused custom code, a raising reward function under on_error=raise, ..."""

    exit_code, kind = 11, "reward"
